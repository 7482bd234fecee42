"""The producer: draw prompts, generate, score, and hand over batches or whole prompt groups
with their origin. A sampler thread drives it today (`async_mode.SamplerWorker`, and the
sequential modes in the learner's thread); anything that can call `generate` or iterate `stream`
can drive it (e.g. a sampler on another machine).

Scoring is a stage of its own (`tasks.scoring.Scorer`): `generate` hands the sampled rows to the
scorer and returns a `Pending` at once, so a sampler decodes its next draw while the last one is
checked; `stream` hands each finished group over the same way and yields it once scored.

A multi-turn task's rows are episodes (`tasks.multiturn`): the environment answers each turn as
it ends, so an episode's reward is settled when its row ends, and `episode_totals` counts turns,
tool calls and observation tokens for the metrics.

Draw `d` of worker `w` is seeded by both (`draw`), so it is the same prompts and sampling keys
whenever it is drawn again: what was lost at a stop is regenerated exactly from its origin.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable, Iterable, Iterator, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import advantages
from jaxrl_llm.parallel import distributed
from jaxrl_llm.batch import TrajectoryBatch
from jaxrl_llm.rollout.sampler import to_batch
from jaxrl_llm.tasks import envs, multiturn
from jaxrl_llm.tasks.scoring import Scored, Scorer

INFLIGHT_GROUPS_PER_WORKER = 4  # streamed groups being scored before the sampler waits for the oldest


class Origin(NamedTuple):
    """Where a queue item came from: sampler `worker`'s draw `draw`, prompt groups `groups`
    of it (None: all of them). Delivered to the data position once trained or dropped."""

    worker: int
    draw: int
    groups: Optional[tuple] = None


class Rollout(NamedTuple):
    """A queue item: scored rows (a whole draw, or one prompt group) and their origin."""

    origin: Origin
    batch: TrajectoryBatch


class Pending:
    """Sampled rows whose rewards are being computed: `result()` -> (batch with rewards and
    advantages, failed rewards). `score_s`: the seconds scoring took from the sampler's thread
    (scoring in it, or waiting for the scorer), once `result()` returned."""

    def __init__(self, producer: "Producer", batch: TrajectoryBatch, scored: Scored):
        self._producer, self._batch, self._scored = producer, batch, scored

    def done(self) -> bool:
        return self._scored.done()

    @property
    def score_s(self) -> float:
        return self._scored.seconds

    def result(self):
        rewards, failures = self._scored.result()
        return self._producer.with_rewards(self._batch, rewards), failures


@dataclasses.dataclass
class _Draw:
    """A streamed draw in flight: its prompts, padded rows, groups not yet handed over, and the
    params version it was admitted under."""

    prompts: list
    tokens: np.ndarray
    mask: np.ndarray
    pending: int
    version: int


class Producer:
    def __init__(self, sampler, task, cfg, scorer: Optional[Scorer] = None):
        """`cfg`: the runtime section (prompts_per_batch, seed, advantage, mask_zero_variance);
        `scorer`: the scoring stage (default: `task.reward` in a scorer thread)."""
        self.sampler, self.task, self.scorer = sampler, task, scorer or Scorer(task)
        self.prompts_per_batch, self.group_size = cfg.prompts_per_batch, sampler.cfg.num_samples
        self.advantage, self.mask_zero_variance, self.seed = cfg.advantage, cfg.mask_zero_variance, cfg.seed
        self.advantage_kw = dict(eps=cfg.advantage_eps, singleton=cfg.singleton_groups) if cfg.advantage == "grpo" else {}
        self._key = jax.random.key(cfg.seed)
        self.multi_turn = multiturn.is_multi_turn(task)
        self.episodes = self.multi_turn or hasattr(task, "rollouts")  # rows are episodes: their totals kept
        self._totals, self._totals_lock = np.zeros(len(envs.TOTALS)), threading.Lock()

    def episode_totals(self) -> np.ndarray:
        """`envs.TOTALS` summed over every episode this producer settled (multi-turn tasks)."""
        with self._totals_lock:
            return self._totals.copy()

    def load_episode_totals(self, totals) -> None:
        """Continue `episode_totals` from a checkpoint (None: one written without them)."""
        if totals is not None and len(totals) == len(envs.TOTALS):
            with self._totals_lock:
                self._totals = np.asarray(totals, np.float64)

    def add_episode_totals(self, totals) -> None:
        """Episodes settled elsewhere (a sampler node's, `envs.TOTALS` sums; None: none) join this
        producer's."""
        if totals is None:
            return
        with self._totals_lock:
            self._totals += totals

    def _settled(self, batch: TrajectoryBatch, totals) -> Pending:
        self.add_episode_totals(totals)
        return Pending(self, batch, Scored.given(np.asarray(batch.rewards)))

    @property
    def prompt_width(self) -> int:
        """The prompt span of every streamed row: the bucket of the task's longest prompt."""
        return self.sampler.bucket(getattr(self.task, "max_prompt_len", self.sampler.cfg.prompt_buckets[-1]))

    @property
    def streams(self) -> bool:
        """Whether groups are streamed as they finish (continuous batching) rather than batched."""
        return self.sampler.cfg.batching == "continuous" and not hasattr(self.task, "rollouts")

    def prompts(self, worker: int, counter: int) -> list:
        """The prompts of draw `counter` of sampler `worker` (see `draw`)."""
        rng = np.random.default_rng(distributed.seed_ids(self.seed, worker, counter))
        return self.task.prompts(rng, self.prompts_per_batch)

    def draw(self, worker: int, counter: int):
        """Draw `counter` of sampler `worker`: (prompts, sampling key). With many processes each
        draws prompts and samples of its own (`distributed.seed_ids`)."""
        prompts = self.prompts(worker, counter)
        key = self._key
        for i in distributed.seed_ids(worker, counter):
            key = jax.random.fold_in(key, i)
        return prompts, key

    def score(self, batch: TrajectoryBatch, prompts) -> Pending:
        """Start scoring sampled rows (row i answers prompts[i // G]); a failing reward scores 0."""
        scored = self.scorer.submit(prompts, np.asarray(batch.tokens), np.asarray(batch.loss_mask) > 0,
                                    self.group_size)
        return Pending(self, batch, scored)

    def with_rewards(self, batch: TrajectoryBatch, rewards: np.ndarray) -> TrajectoryBatch:
        """The batch with its rewards and their advantages (within each group)."""
        adv = advantages.compute(self.advantage, rewards, batch.group_ids, batch.loss_mask,
                                 mask_zero_variance=self.mask_zero_variance, **self.advantage_kw)
        return batch.replace(rewards=jnp.asarray(rewards), advantages=adv)

    def generate(self, params, version: int, worker: int, counter: int, refresh=None) -> Pending:
        """Prompts -> completions (policy `version`; `refresh` may swap weights mid-generation,
        see `Sampler.generate`), handed to the scorer: returns while they are scored."""
        prompts, key = self.draw(worker, counter)
        if hasattr(self.task, "rollouts"):  # the task plays its own rows (e.g. agents through the gateway)
            return self._settled(*self.task.rollouts(self.sampler, params, prompts, key, version, refresh))
        if self.multi_turn:
            return self._settled(*multiturn.generate(self.sampler, self.task, params, prompts, key, version, refresh))
        return self.score(self.sampler.generate(params, prompts, key, version, refresh=refresh), prompts)

    def stream(self, worker: int, params, version: int, todo: Iterable, refresh: Callable, stop: Callable,
               admit: Optional[Callable] = None) -> Iterator[tuple[Rollout, int, int, float]]:
        """Continuous batching for async sampler `worker` (its draws are `draw(worker + 1, d)`;
        0 is the sequential modes'): the draws of `todo` ((draw, groups not yet delivered) pairs) feed
        the decode slots; each prompt group is handed to the scorer once its G rows have finished
        and yielded once scored, as (Rollout, the params version its draw was admitted under,
        failed rewards, seconds scoring took from this thread: `Pending.score_s`).
        `todo` may yield None while it has nothing to hand out (the slots then idle until it does).
        `refresh()` as in `Sampler.generate` (it also gives the version `admit` is asked with:
        `admit(worker version, groups)` may hold a draw back); `stop()` ends the stream."""
        sampler, g = self.sampler, self.group_size
        per_draw = self.prompts_per_batch * g
        engine = sampler.slots(per_draw)
        p = self.prompt_width
        todo = iter(todo)
        upcoming = [None]  # the next draw, taken from `todo` when slots are free, consumed once admitted
        drawn: dict[int, _Draw] = {}
        parts: dict[int, dict] = {}  # group -> {row id: outputs}
        at = [version]  # the params version the slots decode with now
        eps = turns = None
        if self.multi_turn:  # row id r is row r % per_draw of draw r // per_draw
            eps = multiturn.episodes(self.task, lambda r: drawn[r // per_draw].prompts[r % per_draw // g])
            turns = multiturn.turns(eps, release=True, max_obs=self.task.turn.max_obs_tokens)

        def feed():
            if upcoming[0] is None:
                upcoming[0] = next(todo)
                if upcoming[0] is None:  # nothing to hand out now (a sampler node between leases)
                    return ()
            draw, groups = upcoming[0]
            if admit is not None and not admit(at[0], len(groups)):
                return ()  # held back: the learner could not train these tokens within the bound
            upcoming[0] = None
            prompts, key = self.draw(worker + 1, draw)
            toks, mask, _ = sampler.pad_prompts(prompts, width=p)
            if toks.shape[1] != p:
                raise ValueError(f"a prompt is longer than the task's max_prompt_len bucket {p}")
            drawn[draw] = _Draw(prompts, toks, mask, len(groups), at[0])
            rows = np.concatenate([k * g + np.arange(g) for k in groups])  # only groups not yet delivered
            return (draw * per_draw + rows, toks[rows], mask[rows], np.full(len(rows), sampler.cfg.max_new_tokens),
                    engine.row_keys(key, rows))

        def swap():
            newer = refresh()
            if newer is not None:
                at[0] = newer[0]
            return newer

        scoring = collections.deque()  # (groups handed over together, Pending), oldest first
        limit = INFLIGHT_GROUPS_PER_WORKER * max(1, getattr(self.scorer.pool, "workers", 1))
        # in flight: the slots' rows and as many again waiting or parked for their environment
        for ids, got in engine.stream(params, p, version, feed, refresh=swap, stop=stop, turns=turns,
                                      max_rows=2 * per_draw):
            for i, row in enumerate(ids.tolist()):
                parts.setdefault(row // g, {})[row] = {f: x[i] for f, x in got.items()}
            complete = [k for k, v in parts.items() if len(v) == g]
            if complete:
                scoring.append(self._hand_over(complete, drawn, parts, engine, eps))
            while scoring and (scoring[0][1].done() or sum(len(s[0]) for s in scoring) > limit):
                sel, pending = scoring.popleft()
                yield from self._yield_groups(worker, sel, *pending.result(), pending.score_s)
        while scoring:  # the stream ended: what was decoded is still delivered
            sel, pending = scoring.popleft()
            yield from self._yield_groups(worker, sel, *pending.result(), pending.score_s)

    def _hand_over(self, complete, drawn, parts, engine, eps=None):
        """Hand the groups that completed together to the scorer as one batch (advantages stay
        within each group), or settle their episodes (`eps`: multi-turn): ([(draw, prompt in
        draw, admitted version)], Pending)."""
        g = self.group_size
        prompts, sel = [], []
        for group in complete:
            draw, prompt = divmod(group, self.prompts_per_batch)
            prompts.append(drawn[draw].prompts[prompt])
            sel.append((draw, prompt, prompt * g + np.arange(g)))
            drawn[draw].pending -= 1
        items = [kv for group in complete for kv in sorted(parts.pop(group).items())]
        out = {f: np.stack([r[f] for _, r in items]) for f in items[0][1]}
        toks = np.concatenate([drawn[d].tokens[r] for d, _, r in sel])
        mask = np.concatenate([drawn[d].mask[r] for d, _, r in sel])
        batch = to_batch(toks, mask, np.repeat(np.arange(len(complete)), g), engine.outputs(out))
        if eps is not None:
            pending = self._settled(*multiturn.settle(eps, batch, [i for i, _ in items], toks.shape[1]))
        else:
            pending = self.score(batch, prompts)
        sel = [(d, prompt, drawn[d].version) for d, prompt, _ in sel]
        for draw in {d for d, _, _ in sel if drawn[d].pending == 0}:
            del drawn[draw]
        return sel, pending

    def _yield_groups(self, worker, sel, batch, failures, waited):
        g = self.group_size
        batch = jax.tree.map(np.asarray, batch)
        for i, (draw, prompt, admitted) in enumerate(sel):
            group = jax.tree.map(lambda x: x[i * g:(i + 1) * g], batch)
            yield Rollout(Origin(worker, draw, (prompt,)), group), admitted, failures, waited
            failures, waited = 0, 0.0  # counted once, with the first group
