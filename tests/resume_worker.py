"""Run learner steps in a fresh process: `python -m tests.resume_worker MODE CKPT_DIR OUT.npz`.

MODE straight: steps 0-5; first: steps 0-2 then checkpoint; second: restore, steps 3-5.
Jackpot with a jointly trained actor and a KL reference swapped every 2 steps, so params,
optimizer, rng (Bernoulli masks), actor and reference all have to survive the restart.
"""

import sys

import jax
import numpy as np

from jaxrl_llm import models, testing
from jaxrl_llm.store import checkpoint
from jaxrl_llm.learner import learner as L
from jaxrl_llm.models.config import ModelConfig

CFG = ModelConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)


def main(mode, ckpt_dir, out):
    c = L.default_config()
    c.lr, c.num_minibatches, c.ref_swap_every = 3e-3, 2, 2
    lrn = L.Learner(CFG, {"name": "jackpot", "kl": {"coef": 0.05}}, c, aux_model_cfg=CFG.replace(num_layers=1))
    state = lrn.init(jax.random.key(0))
    data_params = models.init_params(CFG, jax.random.key(99))  # batches independent of training
    batches = [testing.model_batch(data_params, CFG, seed=i, version=i) for i in range(6)]
    ck = checkpoint.Checkpointer(ckpt_dir)
    steps = range(6)
    if mode == "first":
        steps = range(3)
    elif mode == "second":
        state = lrn.place(ck.restore(state))
        steps = range(int(state.version), 6)
    for i in steps:
        state, _ = lrn.train_step(state, batches[i])
    if mode == "first":
        ck.save(state, force=True)
        ck.close()
        return
    flat = {f"{jax.tree_util.keystr(k)}": np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(state)}
    np.savez(out, **flat)


if __name__ == "__main__":
    main(*sys.argv[1:])
