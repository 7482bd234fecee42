"""Default experiment: embedded 2-digit addition, tiny Qwen2-style model warm-started on the
task to 20% accuracy, asynchronous sampling, A-3PO with groups of 16 samples per prompt, 3,000
steps with a cosine learning rate. Runs on a 2-core CPU with no downloads (how long: the README).

    python -m jaxrl_llm.main --config=configs/default.py --workdir=runs/default
    python -m jaxrl_llm.main --config=configs/default.py:gepo --config.runtime.max_staleness=8 ...

`arg` (after the colon) picks the objective.
"""

import ml_collections

from jaxrl_llm.gateway import config as gateway_config
from jaxrl_llm.run import config as config_lib
from jaxrl_llm.run import tracking
from jaxrl_llm import objectives, tasks
from jaxrl_llm.learner import learner
from jaxrl_llm.parallel import distributed, sharding
from jaxrl_llm.rollout import sampling
from jaxrl_llm.runtime import orchestrator
from jaxrl_llm.tasks import warmstart


def get_config(arg: str = "a3po"):
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.cpu_devices = 0  # CPU only: JAX devices to expose (-1: one per core; 0: JAX's default, one)
    c.task = tasks.default_config()  # arithmetic, 2-digit addition, 128 held-out problems
    c.model = config_lib.model_config()  # hf_path: a local HF directory; empty: this tiny random model
    c.aux_model = config_lib.aux_model_config()  # a second model (configs/jackpot_small_actor.py); off
    c.warm_start = warmstart.default_config()  # until 20% validation accuracy: RL has room and signal
    c.sampler = sampling.default_config()
    # 16 per prompt (DAPO's group size): with 8, a seed whose policy is wrong on every sample of a
    # problem gets no signal there and its held-out reward stalls (CHANGELOG has the runs)
    c.sampler.num_samples = 16
    c.objective = objectives.default_config(arg)
    c.learner = learner.default_config()
    c.learner.lr = 1e-4  # 3e-4 collapses the policy on this task
    c.learner.num_minibatches = 4
    c.learner.schedule = "cosine"  # decays over the run (below): a steady final policy, not a noisy one
    c.runtime = orchestrator.default_config()
    c.runtime.mode = "async"
    c.runtime.prompts_per_batch = 32
    c.runtime.max_staleness = 4
    c.mesh = sharding.default_config()
    c.distributed = distributed.default_config()  # many hosts: see README "Many hosts"
    c.train = config_lib.train_config()  # steps, eval/save cadence, resume, preemption grace
    c.gateway = gateway_config.default_config()  # task.name=agent: agents over an OpenAI-style gateway
    c.logging = tracking.default_config()  # tensorboard (default), wandb, mlflow; metrics.jsonl always
    c.train.update(dict(steps=3000, eval_every=100, save_every=500))
    # The schedule spans the run however --config.train.steps or num_minibatches are overridden.
    c.learner.total_steps = c.train.get_ref("steps") * c.learner.get_ref("num_minibatches")
    return c
