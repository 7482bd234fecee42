"""Default experiment: embedded 2-digit addition, tiny Qwen2-style model warm-started on the
task, asynchronous sampling, A-3PO. Runs on a 2-core CPU with no downloads.

    python -m jaxrl_llm.main --config=configs/default.py --workdir=runs/default
    python -m jaxrl_llm.main --config=configs/default.py:gepo --config.runtime.max_staleness=8 ...

`arg` (after the colon) picks the objective.
"""

import ml_collections

from jaxrl_llm import distributed, learner, objectives, sharding, tasks
from jaxrl_llm.runtime import orchestrator


def get_config(arg: str = "a3po"):
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.cpu_devices = 0  # CPU only: JAX devices to expose (-1: one per core; 0: JAX's default, one)
    c.task = tasks.default_config()  # arithmetic, 2-digit addition, 128 held-out problems
    # hf_path: a local Hugging Face directory (config.json + safetensors); empty -> the tiny
    # random model below, warm-started on the task.
    c.model = ml_collections.ConfigDict(dict(
        hf_path="", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, dtype="float32"))
    # A second model for objectives that train an auxiliary decoder (e.g. Jackpot's rollout actor):
    # hf_path, or a random model of hidden_size > 0 warm-started like the policy; off by default.
    # See configs/jackpot_small_actor.py.
    c.aux_model = ml_collections.ConfigDict(dict(
        hf_path="", hidden_size=0, intermediate_size=0, num_layers=0, num_heads=0, num_kv_heads=0, head_dim=0,
        dtype="float32"))
    # ~750 supervised steps give ~40% held-out accuracy: partial, so RL has room and signal.
    c.warm_start = ml_collections.ConfigDict(dict(steps=750, batch_size=64, lr=1e-3))
    c.sampler = ml_collections.ConfigDict(dict(
        temperature=1.0, top_k=0, top_p=1.0, num_samples=8, capture_topk=4, max_new_tokens=0))  # 0: task's max
    c.objective = objectives.default_config(arg)
    c.learner = learner.default_config()
    c.learner.lr = 1e-4  # 3e-4 collapses the policy on this task
    c.learner.num_minibatches = 4
    c.runtime = orchestrator.default_config()
    c.runtime.mode = "async"
    c.runtime.prompts_per_batch = 32
    c.runtime.max_staleness = 4
    c.mesh = sharding.default_config()
    c.distributed = distributed.default_config()  # many hosts: see README "Many hosts"
    # resume: auto continues from the newest readable checkpoint in the workdir (damaged newer
    # ones are reported and moved aside); fresh moves the checkpoints aside and starts over.
    # preempt_grace_s: after SIGTERM / Ctrl-C, the seconds the final save may take.
    c.train = ml_collections.ConfigDict(dict(steps=300, eval_every=50, save_every=50, keep=2,
                                             tensorboard=True, progress=True, resume="auto",
                                             preempt_grace_s=30.0))
    return c
