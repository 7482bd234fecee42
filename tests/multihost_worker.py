"""One process of a many-process learner run:
`python -m tests.multihost_worker PID N PORT DEVICES OUT [OBJECTIVE,...]`.

Every process builds the same 16-row global batch (4 groups of 4) and feeds the learner its own
rows, with group ids numbered from 0 as each process's sampler numbers them; the learner's mesh
(data=2 x fsdp=2) spans all processes' devices. Process 0 writes the params after 3 steps
(gathered onto its devices) and every step's metrics to OUT (.npz); many processes compute the
metrics on a gathered copy of the rows (`minibatches.replicate_rows`), one process does not.
With N=1 the one process feeds all rows: the reference the many-process run must equal. Its
rows come in the order that gives it the two-process minibatches (`jaxrl_llm.learner.minibatches`:
minibatch m holds every process's m-th chunk of its rows). Each objective of the list trains
its own learner in turn (keys prefixed `<objective>/`), in the same processes.
"""

import os
import sys

import jax


def main(pid, n, port, devices, out, objectives="decoupled_ppo"):
    jax.config.update("jax_num_cpu_devices", int(devices))
    from jaxrl_llm.parallel import distributed

    cfg = distributed.default_config()
    if int(n) > 1:
        cfg.update(dict(coordinator_address=f"127.0.0.1:{port}", num_processes=int(n), process_id=int(pid)))
    before = set(os.listdir("/proc/self/task"))
    distributed.initialize(cfg)
    import numpy as np

    from jaxrl_llm.learner import learner as L
    from jaxrl_llm import models, testing
    from jaxrl_llm.parallel import sharding
    from jaxrl_llm.models.config import ModelConfig

    model = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=8)
    c = L.default_config()
    c.lr, c.num_minibatches = 3e-3, 2
    mesh = sharding.make_mesh(dict(data=2, fsdp=2, tensor=1, rules=sharding.DEFAULT_RULES))
    data_params = models.init_params(model, jax.random.key(7))
    rows = 16 // distributed.count()
    # 1 process: [process 0's chunk 0, process 1's chunk 0, process 0's chunk 1, ...] of 2 processes
    mine = (np.arange(16).reshape(2, 2, 4).transpose(1, 0, 2).reshape(-1) if distributed.count() == 1
            else np.arange(distributed.index() * rows, (distributed.index() + 1) * rows))
    saved = {}
    for objective in objectives.split(","):
        lrn = L.Learner(model, {"name": objective, "kl": {"coef": 0.05}}, c, mesh=mesh)
        state = lrn.init(jax.random.key(0))
        metrics = {}
        for i in range(3):
            batch = testing.model_batch(data_params, model, seed=i, num_prompts=4, group_size=4, version=i)
            batch = jax.tree_util.tree_map(lambda x: np.asarray(x)[mine], batch)
            batch = batch.replace(group_ids=batch.group_ids - batch.group_ids.min())  # a process numbers its own
            state, m = lrn.train_step(state, batch)
            for k, v in m.items():
                if not k.endswith(("time_s", "tokens_per_s")):
                    metrics.setdefault(f"{objective}/metric/{k}", []).append(v)
        params = distributed.to_local(state.params)
        saved.update({f"{objective}/{jax.tree_util.keystr(k)}": np.asarray(v)
                      for k, v in jax.tree_util.tree_leaves_with_path(params)})
        saved.update({k: np.asarray(v) for k, v in metrics.items()})
    if int(n) > 1:  # every thread started from initialize on (XLA's, gloo's I/O thread) runs under SCHED_BATCH
        started = set(os.listdir("/proc/self/task")) - before
        policies = {t: os.sched_getscheduler(int(t)) for t in started}
        assert len(started) > 5 and set(policies.values()) == {os.SCHED_BATCH}, policies
    if distributed.is_main():
        np.savez(out, **saved)


if __name__ == "__main__":
    main(*sys.argv[1:])
