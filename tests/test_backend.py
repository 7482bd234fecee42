"""The rollout backend seam (`rollout/backend.py`): a backend written in one file and registered
by name is what every mode samples with. The fake below answers deterministically; the
producer, the sync and async modes and a multi-turn episode run on it unchanged."""

import jax
import numpy as np
import pytest

from jaxrl_llm.learner import learner as L
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.rollout import SamplerConfig, backend
from jaxrl_llm.rollout.sampler import to_batch
from jaxrl_llm.runtime import orchestrator as O
from jaxrl_llm.runtime.producer import Producer
from jaxrl_llm.tasks.scoring import Scorer

EOS, V = 1, 16


class Fake:
    """Sample g of prompt x is `answer(x, g)` then EOS, each token at log-prob -0.5 and the
    version asked; a multi-turn row ends each turn with the task's turn-stop token and asks its
    environment (`turns.respond`), whose observation it appends."""

    def __init__(self, model_cfg, cfg, mesh=None):
        self.model_cfg, self.cfg, self.reprefill = model_cfg, cfg, dict(rows=0, tokens=0, abs_sum=0.0, abs_max=0.0)

    def bucket(self, length):
        return next(b for b in self.cfg.prompt_buckets if length <= b)

    def pad_prompts(self, prompts, width=None):
        p, g = max(width or 0, self.bucket(max(map(len, prompts)))), self.cfg.num_samples
        toks = np.array([[self.cfg.pad_token_id] * (p - len(x)) + list(x) for x in prompts], np.int32)
        return np.repeat(toks, g, 0), np.repeat((toks != self.cfg.pad_token_id).astype(np.int32), g, 0), \
            np.repeat(np.arange(len(prompts), dtype=np.int32), g)

    def place_params(self, params):
        return params

    def slots(self, rows):
        raise NotImplementedError("this backend batches statically")

    def generate(self, params, prompts, key, version=0, refresh=None, limits=None, turns=None):
        toks, mask, groups = self.pad_prompts(prompts)
        n, k, b = self.cfg.max_new_tokens, self.cfg.capture_topk, len(toks)
        out = dict(tokens=np.full((b, n), self.cfg.pad_token_id, np.int32), valid=np.zeros((b, n), bool),
                   obs=np.zeros((b, n), bool), done=np.zeros(b, bool))
        for r, prompt in enumerate(list(x) for x in prompts for _ in range(self.cfg.num_samples)):
            row = self._episode(r, prompt, r % self.cfg.num_samples, turns) if turns else \
                [(t, False) for t in answer(prompt, r % self.cfg.num_samples)] + [(self.cfg.eos_token_id, False)]
            row = row[:n]
            out["tokens"][r, :len(row)] = [t for t, _ in row]
            out["obs"][r, :len(row)] = [o for _, o in row]
            out["valid"][r, :len(row)] = True
            out["done"][r] = len(row) < n or row[-1][0] == self.cfg.eos_token_id
        drawn = out["valid"] & ~out["obs"]
        out.update(logp=np.where(drawn, -0.5, 0.0).astype(np.float32), versions=np.where(drawn, version, -1),
                   topk_ids=np.zeros((b, n, k), np.int32), topk_logp=np.zeros((b, n, k), np.float32))
        return to_batch(toks, mask, groups, out)

    def _episode(self, r, prompt, g, turns):
        row, n = [], self.cfg.max_new_tokens
        while len(row) < n:
            row += [(t, False) for t in answer(prompt + [len(row)], g)[:1] + [self.cfg.turn_stop_ids[0]]]
            if len(row) >= n:
                break
            reply = turns.respond(r, np.array([t for t, _ in row]), np.array([o for _, o in row])).result(timeout=60)
            if reply.done or not len(reply.obs_ids):
                break
            row += [(int(t), True) for t in list(reply.obs_ids)[:min(turns.max_obs, n - len(row))]]
        return row


def answer(prompt, g):
    """The fake's tokens for sample g of `prompt`: never EOS or padding."""
    return [(int(sum(prompt)) + g + j) % (V - 3) + 3 for j in range(3)]


class TargetTask:
    def prompts(self, rng, n):
        return [rng.integers(3, V, rng.integers(1, 4)).tolist() for _ in range(n)]

    def reward(self, prompt, completion):
        return float(np.mean(np.asarray(completion) == 5)) if completion else 0.0


@pytest.fixture(scope="module")
def fake():
    backend.register("fake", Fake)
    yield
    backend._BACKENDS.pop("fake")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_mode_trains_on_what_a_registered_backend_sampled(fake, mode):
    cfg = ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=8, eos_token_id=EOS)
    sampler = backend.make(cfg, SamplerConfig(max_new_tokens=5, num_samples=4, capture_topk=0, prompt_buckets=(4,),
                                              eos_token_id=EOS, backend="fake"))
    assert isinstance(sampler, Fake) and isinstance(sampler, backend.RolloutBackend)
    lc = L.default_config()
    lc.num_minibatches = 1
    lrn = L.Learner(cfg, {"name": "ppo"}, lc)
    rc = O.default_config()
    rc.mode, rc.prompts_per_batch = mode, 2
    orch = O.Orchestrator(lrn, sampler, TargetTask(), rc, scorer=Scorer(TargetTask()))
    trained, real = [], lrn.train_step
    lrn.train_step = lambda st, batch: (trained.append(jax.device_get(batch)), real(st, batch))[1]
    try:
        state, hist = orch.run(lrn.init(jax.random.key(0)), 2)
    finally:
        orch.close()
    assert len(hist) == 2 and all(np.isfinite(m["loss"]) for m in hist)
    for batch in trained:
        for r, (row, drawn) in enumerate(zip(batch.tokens, batch.loss_mask > 0)):
            prompt = [t for t in row[:4] if t != 0]
            assert row[drawn].tolist() == answer(prompt, r % 4) + [EOS]
            assert (batch.versions[r][drawn] <= int(state.version)).all() and (batch.behav_logp[r][drawn] == -0.5).all()


def test_a_multi_turn_episode_runs_through_the_producer_on_a_registered_backend(fake):
    from jaxrl_llm.tasks.multiturn import TurnConfig
    from jaxrl_llm.tasks.tool_arithmetic import END, VOCAB_SIZE, ToolArithmetic

    task = ToolArithmetic(turn=TurnConfig(max_turns=3))
    try:
        cfg = ModelConfig(vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=8, eos_token_id=task.eos_id)
        sampler = backend.make(cfg, SamplerConfig(max_new_tokens=24, num_samples=2, capture_topk=0,
                                                  prompt_buckets=task.prompt_buckets, eos_token_id=task.eos_id,
                                                  pad_token_id=task.pad_id, turn_stop_ids=(END,), backend="fake"))
        rc = O.default_config()
        rc.prompts_per_batch = 2
        batch, _ = Producer(sampler, task, rc).generate(None, 3, 0, 0).result()
        batch = jax.device_get(batch)
        p = batch.tokens.shape[1] - 24
        obs = (batch.input_mask[:, p:] > 0) & (batch.loss_mask[:, p:] == 0)
        assert obs.any(axis=1).all()  # every episode got the environment's observations
        drawn = batch.loss_mask[:, p:] > 0
        assert (batch.versions[:, p:][obs] == -1).all() and (batch.versions[:, p:][drawn] == 3).all()
        ends = (batch.tokens[:, p:] == END) & (batch.loss_mask[:, p:] > 0)
        assert (ends.sum(1) == 3).all()  # three turns each: the turn limit ended every episode
        assert batch.rewards.shape == (4,) and batch.truncated.all()  # flagged: ended by the turn limit
    finally:
        task.close()
