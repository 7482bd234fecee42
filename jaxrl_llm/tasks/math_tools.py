"""Math problems from a local dataset with a sandboxed Python tool, in the tokenizer's own
chat format (`task.name=math_tools`).

The prompt goes through the chat template with the tool declared (`tools=[PYTHON]`, for
templates that render tools; the instruction names the call format for those that do not). The
model calls the tool Hermes / Qwen style, `<tool_call>{"name": "python", "arguments": {"code":
"..."}}</tool_call>`; the closing tag is one token of the tokenizer and ends the model's turn.
The snippet runs in the sandbox (`sandbox.ToolRunner`: timeout, no network, scratch directory)
and its output comes back as a tool message rendered by the same chat template: the
observation is the rendered text that follows the model's turn (the end of the assistant
message, the tool message, the next assistant header), tokenised on its own. The model's own
tokens are never decoded and re-encoded: the row holds exactly the ids it sampled.

The episode's reward is math-verify's verdict on the final assistant turn (the text after the
last observation), checked like the single-turn `math` task's (fast integer path, else a worker
process with a timeout). A bad call (not JSON, another tool's name, no code) is answered with an
error message and counted.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from typing import Sequence

import numpy as np

from jaxrl_llm.tasks import envs, math_dataset, multiturn, tools
from jaxrl_llm.tasks.scoring import Scorer

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON = {"type": "function", "function": {
    "name": "python", "description": "Run Python code and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The code to run."}},
                   "required": ["code"]}}}
INSTRUCTION = (math_dataset.INSTRUCTION + " You may run Python: write " + CALL_OPEN
               + '{"name": "python", "arguments": {"code": "print(1 + 1)"}}' + CALL_CLOSE + " and read its output.")
_SENTINEL = "\u2063TURN\u2063"  # an assistant message's content, to find where the template closes it


class MathTools(math_dataset.MathDataset):
    """`MathDataset` with a Python tool over several turns (`multiturn`)."""

    def __init__(self, *args, turn: multiturn.TurnConfig = multiturn.TurnConfig(env="python"),
                 reward_workers: int = 1, reward_timeout: float = 5.0, **kw):
        kw.setdefault("instruction", INSTRUCTION)
        super().__init__(*args, reward_workers=reward_workers, reward_timeout=reward_timeout, **kw)
        ids = self.tokenizer.encode(CALL_CLOSE, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"task 'math_tools' ends a model turn at {CALL_CLOSE!r}, which this tokenizer splits into "
                             f"{len(ids)} tokens; use a tokenizer with tool-call tokens (e.g. Qwen2.5, Qwen3)")
        self.turn, self.turn_stop_ids = turn, (ids[0],)
        self.open_id = self.tokenizer.convert_tokens_to_ids(CALL_OPEN)
        self._frame = _frame(self.tokenizer)
        self._envs = multiturn.Environments(self, turn)
        self._checks = (reward_workers, reward_timeout)

    def _format(self, question: str) -> list[int]:
        if not self._chat:
            return super()._format(question)
        text = f"{question}\n{self._instruction}".strip()
        msgs = ([{"role": "system", "content": self._system}] if self._system else []) + [
            {"role": "user", "content": text}]
        ids = self.tokenizer.apply_chat_template(msgs, tools=[PYTHON], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def environment(self) -> envs.Environment:
        return self._envs.get()

    def observation(self, output: str, limit: int) -> tuple:
        """The ids that follow a model turn ending in a tool call: the template's frame around a
        tool message holding `output`, the output's tokens cut so that all fit in `limit`."""
        head, tail = self._frame
        body = self.tokenizer.encode(output, add_special_tokens=False)
        room = max(limit - len(head) - len(tail), 0)
        return tuple(head + body[:room] + tail)

    def close(self) -> None:
        self._envs.close()


def _frame(tokenizer) -> tuple:
    """(ids before, ids after) a tool message's content, as the chat template renders what
    follows an assistant turn that called a tool: the turn's closing, the tool message, the next
    assistant header."""
    user = {"role": "user", "content": "q"}
    said = {"role": "assistant", "content": _SENTINEL}
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tools=[PYTHON], tokenize=False,  # noqa: E731
                                                             add_generation_prompt=gen)
    turn = render([user, said], False)
    full = render([user, said, {"role": "tool", "content": _SENTINEL}], True)
    if not full.startswith(turn[:turn.index(_SENTINEL)]) or full.count(_SENTINEL) != 2:
        raise ValueError("the chat template does not render a tool message after an assistant turn")
    after = full[full.index(_SENTINEL) + len(_SENTINEL):]  # the turn's closing, then the tool message
    before, rest = after.split(_SENTINEL)
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    return enc(before), enc(rest)


class PythonTool:
    """The environment of `MathTools`: each turn's tool call runs in the sandbox (`runner`)."""

    def __init__(self, task: MathTools, runner):
        self.task, self.runner = task, runner
        self.stop_ids = task.turn_stop_ids
        self._scorer = None

    def reply(self, prompt, episode, obs) -> Future:
        limit = self.task.turn.max_obs_tokens
        code, problem = _code(self.task, list(episode[envs.turn_start(obs):]))
        if problem:
            out: Future = Future()
            out.set_result(envs.Reply(obs_ids=self.task.observation(f"error: {problem}", limit), tool_calls=1,
                                      tool_errors=1))
            return out
        return envs.tool_reply(self.runner.submit(tools.python, [(code,)]),
                               lambda r: (self.task.observation(r.text, limit), False))

    def final(self, prompt, episode, obs) -> float:
        """math-verify on the last turn, as the `math` task scores a completion (its fast path,
        else a checker process with a timeout; a check that fails or overruns scores 0)."""
        if self._scorer is None:
            workers, timeout = self.task._checks
            self._scorer = Scorer(self.task, workers, timeout, background=False)
        last = np.asarray([episode[envs.turn_start(obs):]], np.int32)
        rewards, _ = self._scorer.score([prompt], last, np.ones(last.shape, bool), 1)
        return float(rewards[0])

    def close(self) -> None:
        if self._scorer is not None:
            self._scorer.close()


def _code(task: MathTools, turn: Sequence[int]):
    """(code, None) from the turn's last tool call, or (None, what is wrong with it)."""
    opens = [i for i, t in enumerate(turn) if t == task.open_id]
    if not opens:
        return None, f"a {CALL_CLOSE} without {CALL_OPEN}"
    text = task.tokenizer.decode(list(turn[opens[-1] + 1:-1]))
    try:
        call = json.loads(text)
    except ValueError:
        return None, "the tool call is not JSON"
    if not isinstance(call, dict) or call.get("name") != "python":
        return None, 'unknown tool; valid: "python"'
    code = (call.get("arguments") or {}).get("code") if isinstance(call.get("arguments"), dict) else None
    if not isinstance(code, str) or not code.strip():
        return None, 'the call has no "code" argument'
    return code, None


@envs.register("python")
def _python(task, runner):
    return PythonTool(task, runner)
