"""`task.name=agent`: an agent written against the OpenAI client plays a task's problems through
the gateway, and each of its sessions is one trained row.

The agent is `async def agent(client, problem) -> reward | None` (`task.agent=module:function`),
given a stock `openai.AsyncOpenAI` pointed at its session and `problem` ({"prompt": the
problem's text}); None leaves the reward to the task (`task.source`'s own check on the
transcript, as its built-in environment scores an episode). A prompt draw of P problems opens
P x G sessions, `gateway.concurrency` at a time; a session whose agent fails or times out is
dropped, counted, and played again (up to `gateway.max_attempts` times), so every group keeps its
G rows; at the last attempt a failed session that sampled anything is scored by the task's check
of its transcript instead (an episode the agent did not finish), so an agent's error never stops
the run; only a session with no row at all after every attempt does. A session that branched
trains its last row (the conversation its reward is for); the earlier ones are counted.

With `gateway.external=True` the agents run elsewhere: a draw's sessions wait until agents take
them (`GET /rl/prompts`, each with its problem and base URL), are played there and closed by
`POST /rl/sessions/<id>/reward` (`{"reward": null}`: the task's check); a session not taken or not
closed in time is dropped and played again under a new name, as above.
"""

from __future__ import annotations

import collections
import itertools
import secrets
import threading
import time

import jax
import numpy as np

from jaxrl_llm.gateway import chat, runners, server as server_lib, service, tally
from jaxrl_llm.tasks import arithmetic, envs, multiturn


def format_of(source):
    """How the gateway renders `source`'s conversations: the embedded calculator's ids, or the
    tokenizer's chat template (`task.source=math`, or `math_tools`: its Python tool is then the
    agent's to bring, its tool call closed by the chat turn's end rather than ending the turn)."""
    if isinstance(source, arithmetic.Arithmetic):
        from jaxrl_llm.gateway.embedded import ArithmeticChat

        return ArithmeticChat()
    if getattr(source, "chat_template", False):
        return chat.ChatFormat(source.tokenizer, chat.turn_stop_id(source.tokenizer))
    raise ValueError("task.name=agent plays the embedded tasks (task.source=tool_arithmetic or arithmetic) or a "
                     "dataset its tokenizer's chat template renders (task.source=math or math_tools with "
                     "task.chat_template=True)")


class AgentTask:
    """`source` (a task) whose rows come from agents' sessions through a gateway (`rollouts`);
    every other attribute is the source's (prompts, evaluation, rewards)."""

    GRACE_S = 60.0  # a draw waits for its sessions twice gateway.session_timeout_s and this long

    def __init__(self, source, agent: str, cfg, format=None):
        self.source, self.agent_spec, self.cfg = source, agent, cfg
        self.external = bool(getattr(cfg, "external", False))  # the gateway section's fields, or a test's
        if not self.external:
            runners.load(agent)  # refused at start-up, named
        self.format = format or format_of(source)
        self.gateway = self.server = self.runner = None
        self._lock = threading.Lock()
        self._handed: dict = {}  # session -> its `Closed` (or its name: dropped), until its draw takes it
        self._ids = itertools.count()
        self._waiting: collections.OrderedDict = collections.OrderedDict()  # external: session -> problem
        self.counts = {"dropped": 0, "branch_rows": 0, "agent_errors": 0, "scored_after_failure": 0,
                       "check_failures": 0}
        self.scorer = None  # the run's scoring stage, when it gives one (`run/parts.py`)
        self._given_up: set = set()  # sessions a draw stopped waiting for: their hand-over is dropped

    def __getattr__(self, name):
        if name == "source":
            raise AttributeError(name)
        return getattr(self.source, name)

    # What the training samplers read (`plan.sampler_cfg`); evaluation samples the source as it is.
    @property
    def turn_stop_ids(self) -> tuple:
        return (self.format.stop_id,)

    @property
    def eos_id(self):
        """The source's end token, unless it is the turn's closing one (a chat model's <|im_end|>):
        then a session's row ends when its agent stops asking, at the sampler's budget, or at the
        tokenizer's other end token (<|endoftext|>) when it has one."""
        eos = self.source.eos_id
        if eos != self.format.stop_id:
            return eos
        pad = self.source.pad_id
        return None if pad is None or pad == eos else pad

    @property
    def prompt_buckets(self) -> tuple:
        """The source's, and `gateway.max_prompt_tokens` when an agent's first request renders
        longer than the task's prompts (its own system prompt, its tools' schemas)."""
        buckets = tuple(self.source.prompt_buckets)
        room = getattr(self.cfg, "max_prompt_tokens", 0)
        return buckets + (room,) if room > buckets[-1] else buckets

    @property
    def max_prompt_len(self) -> int:
        return self.prompt_buckets[-1]

    @property
    def max_turns(self) -> int:
        """Model turns per session: a multi-turn source's, else `task.max_turns` (an agent with
        tools of its own on a single-turn dataset)."""
        turn = getattr(self.source, "turn", None)
        return turn.max_turns if turn is not None else getattr(self.cfg, "max_turns", 1)

    def problem(self, prompt) -> dict:
        if hasattr(self.source, "user_text"):
            return {"prompt": self.source.user_text(prompt)}
        return {"prompt": arithmetic.decode([t for t in prompt if t != arithmetic.BOS])}

    def _start(self, sampler, params, version: int) -> None:
        c = self.cfg
        self.gateway = service.Gateway(sampler, self.format, params, version, slots=sampler.cfg.slots or c.concurrency,
                                       max_turns=self.max_turns,
                                       timeout_s=c.session_timeout_s, max_obs=c.max_obs_tokens, seed=c.seed,
                                       named=True)
        token = getattr(c, "token", "") or secrets.token_urlsafe(24)
        self.server = server_lib.Server(self.gateway, c.host, c.port, token=token,
                                        prompts=self.take if self.external else None)
        self.runner = None if self.external else runners.make(self.agent_spec, self.server.url, token, c)

    def take(self, n: int) -> list:
        """External agents' next `n` sessions (`GET /rl/prompts`), oldest first."""
        with self._lock:
            taken = [self._waiting.popitem(last=False) for _ in range(min(n, len(self._waiting)))]
        return [{"session": s, "problem": p, "base_url": self.server.url(s)} for s, p in taken]

    def rollouts(self, sampler, params, prompts, key, version: int = 0, refresh=None):
        """P x G sessions of `prompts` -> (batch, `envs.TOTALS` sums), rows as the sampler lays
        out a static batch (row i * G + g: sample g of prompt i)."""
        with self._lock:  # sampler threads (runtime.num_samplers) share one gateway
            if self.gateway is None:
                self._start(sampler, params, version)
            else:
                self.gateway.publish(version, params)
        g = sampler.cfg.num_samples
        want = [(i, k) for i in range(len(prompts)) for k in range(g)]
        got: dict = {}
        for attempt in range(self.cfg.max_attempts):
            todo = [w for w in want if w not in got]
            if not todo:
                break
            names = {f"d{next(self._ids)}-{i}-{k}-{attempt}": (i, k) for i, k in todo}
            self.gateway.expect(names)  # no other name opens a session
            if self.runner is None:  # external agents take them
                with self._lock:
                    self._waiting.update((s, self.problem(prompts[i])) for s, (i, _) in names.items())
                plays = {}
            else:
                plays = {s: self.runner.start(s, self.problem(prompts[i])) for s, (i, _) in names.items()}
            got.update(self._collect(names, plays, last=attempt == self.cfg.max_attempts - 1))
            with self._lock:  # not taken in time: played again under a new name
                for s in names:
                    self._waiting.pop(s, None)
            self.gateway.forget(names)
        missing = [w for w in want if w not in got]
        if missing:
            raise RuntimeError(f"{len(missing)} of {len(want)} agent sessions failed {self.cfg.max_attempts} times "
                               f"(gateway.max_attempts); last agent error: {list(self.runner.errors)[-1:]}")
        return self._batch([got[w] for w in want], prompts, g)

    def _collect(self, names: dict, plays: dict, last: bool = False) -> dict:
        """Wait for the sessions `names`: each is handed over (its `Closed`) or dropped; `last`:
        a failed session with a row is handed over too, for the task to score."""
        out, open_, settled = {}, set(names), set()
        deadline = time.monotonic() + 2 * self.cfg.session_timeout_s + self.GRACE_S
        while open_ and time.monotonic() < deadline:
            self.gateway.check()
            for s in [s for s in open_ if s in plays and plays[s].done() and s not in settled]:
                settled.add(s)
                try:
                    self.gateway.reward(s, plays[s].result())
                except Exception as e:  # the agent failed, gave a bad reward, or never asked anything
                    self.runner.errors.append((s, repr(e)))
                    self.counts["agent_errors"] += 1
                    if last and self._task_scores(s):
                        continue
                    if not self.gateway.abandon(s):  # no row of it exists: nothing will be handed over
                        open_.discard(s)
                        self.counts["dropped"] += 1
            with self._lock:  # other sampler threads' sessions stay for them
                for c in self.gateway.closed():
                    name = c if isinstance(c, str) else c.session
                    if name in self._given_up:
                        self._given_up.discard(name)
                    else:
                        self._handed[name] = c
                mine = [s for s in open_ if s in self._handed]
                for name in mine:
                    c = self._handed.pop(name)
                    open_.discard(name)
                    if isinstance(c, str):
                        self.counts["dropped"] += 1
                    else:
                        out[names[name]] = c
            time.sleep(0.005)
        if open_:  # still open at the deadline (an agent that never ends its session): closed, dropped
            with self._lock:
                self._given_up.update(open_)
            for s in open_:
                self.gateway.abandon(s)
            self.counts["dropped"] += len(open_)
        return out

    def _task_scores(self, session: str) -> bool:
        """Close a failed session for the task's check (its transcript as it stands); False when
        it cannot be (no row, or already closed)."""
        try:
            self.gateway.reward(session, None)
        except (KeyError, ValueError):
            return False
        self.counts["scored_after_failure"] += 1
        return True

    def _batch(self, closed: list, prompts, g: int):
        """The sessions' last rows in draw order, each scored by its agent or by the task."""
        self.counts["branch_rows"] += sum(len(c.branched) - 1 for c in closed)
        last = jax.tree.map(lambda *x: np.stack([np.asarray(v)[-1] for v in x]), *[c.batch for c in closed])
        rewards = np.asarray([c.reward or 0.0 for c in closed], np.float32)
        checked = [j for j, c in enumerate(closed) if c.reward is None]
        if checked:
            rewards[checked] = self._checked([prompts[j // g] for j in checked], last, checked)
        totals = np.zeros(len(envs.TOTALS))
        totals[envs.TOTALS.index("episodes")] = len(closed)
        totals[envs.TOTALS.index("turns")] = sum(int(c.turns[-1]) for c in closed)
        totals[envs.TOTALS.index("tool_calls")] = sum(int(c.tool_calls[-1]) for c in closed)
        obs = (np.asarray(last.input_mask) > 0) & (np.asarray(last.loss_mask) == 0)
        totals[envs.TOTALS.index("obs_tokens")] = obs[:, self.gateway.width:].sum()
        return last.replace(rewards=rewards, group_ids=np.repeat(np.arange(len(prompts), dtype=np.int32), g)), totals

    def _checked(self, prompts: list, batch, rows: list) -> np.ndarray:
        """The source task's own check of `rows`' transcripts: a multi-turn one's environment;
        else its reward of the model's turns (a tool's output is no answer), through the run's
        scorer when it has one (checks in worker processes, each under a timeout)."""
        if getattr(self.source, "turn", None) is not None:
            env = self.source.environment()
            episodes = multiturn.episode_rows(batch.tokens[rows], batch.input_mask[rows], batch.loss_mask[rows],
                                              self.gateway.width)
            return np.asarray([env.final(list(p), *(x.tolist() for x in e)) for p, e in zip(prompts, episodes)])
        said = np.asarray(batch.loss_mask)[rows] > 0
        if self.scorer is None:
            return np.asarray([self.source.reward(list(p), t[m].tolist())
                               for p, t, m in zip(prompts, np.asarray(batch.tokens)[rows], said)])
        rewards, failures = self.scorer.score(prompts, np.asarray(batch.tokens)[rows], said, 1)
        self.counts["check_failures"] += int(failures)
        return rewards

    def counters(self) -> np.ndarray:
        """`tally.COUNTS` so far: the gateway's sessions by outcome (none before it starts), this
        task's own counts, then its slots' tokens and capacity."""
        c = self.gateway.counts() if self.gateway is not None else {}
        slots = self.gateway.slot_use() if self.gateway is not None else (0, 0)
        gateway = ("opened", "closed", "timed_out", "abandoned", "branched", "refused", "failed")
        mine = ("agent_errors", "branch_rows", "scored_after_failure", "check_failures", "dropped")
        return np.asarray([c.get(k, 0) for k in gateway] + [self.counts[k] for k in mine] + list(slots), np.float64)

    def latencies(self) -> np.ndarray:
        """Milliseconds of the gateway's requests answered since the last call."""
        return self.gateway.latencies() if self.gateway is not None else np.zeros(0)

    def metrics(self) -> dict:
        """`gateway/*`: the counters so far and the request latency percentiles since the last call."""
        if self.gateway is None:
            return {}
        return tally.metrics(self.counters(), self.latencies())

    def close(self) -> None:
        for part in (self.runner, self.server, self.gateway):
            if part is not None:
                part.close()
        if hasattr(self.source, "close"):
            self.source.close()
