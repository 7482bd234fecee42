"""Tasks: prompts + verifiable rewards.

A task has `prompts(rng, n)`, `eval_prompts()`, `reward(prompt_ids, completion_ids)`, and
`eos_id`, `pad_id`, `vocab_size`, `prompt_buckets`, `max_answer_len`; tasks with
`supervised(rng, n)` can warm-start a tiny model; `close()`, if present, is called at the end.
Embedded: `arithmetic` (no download) and `tool_arithmetic` (multi-turn: a calculator tool, see
`multiturn`). From a local dataset: `math` (GSM8K / MATH style, math-verify reward) and
`math_tools` (the same, multi-turn with a sandboxed Python tool in the chat template's format).
`evaluation` draws n samples per problem and scores them; `estimators` turns them into pass@k and
maj@k (the evaluate command and training's scheduled evaluation share both).

It imports the rollout (multi-turn generation), `models`, `batch` and `validation`; never the
learner, the runtime or a run.
"""

from __future__ import annotations

from jaxrl_llm import validation as V
from jaxrl_llm.tasks.scoring import Scorer, default_workers

NAMES = ("arithmetic", "math", "tool_arithmetic", "math_tools", "agent")
# what task.name=agent's agents can play (gateway/agents.py)
SOURCES = ("arithmetic", "tool_arithmetic", "math", "math_tools")
MULTI_TURN = ("tool_arithmetic", "math_tools")
DEFAULT_ENV = {"tool_arithmetic": "calculator", "math_tools": "python"}


SECTION = V.Section(  # every task's fields, so any of them can be set from the command line
    name=("arithmetic", V.one_of(*NAMES)), eval_size=(128, V.integer(1)),
    # arithmetic (reward: exact | digits, partial credit per answer position); difficulty:
    # digits per operand, operators, operands per problem, running results written first
    digits=(2, V.integer(1)), ops=("+", V.text()), reward=("exact", V.one_of("exact", "digits")),
    terms=(2, V.integer(2)), scratchpad=(False, V.boolean()),
    # math: a local dataset path; the tokenizer comes from model.hf_path unless `tokenizer` is set (paths.py)
    path=("", V.anything()), tokenizer=("", V.anything()), split=("train", V.text()), eval_split=("test", V.text()),
    # a dataset with no evaluation split: hold out this fraction of `split` instead (disjoint,
    # drawn with eval_holdout_seed, recorded in the workdir); 0: evaluate on `eval_split`
    eval_holdout=(0.0, V.unit()), eval_holdout_seed=(0, V.integer(0)),
    # gold answers the answer extractor cannot parse: refused above this fraction, dropped below it
    max_unparsed_gold=(0.01, V.unit()),
    eos_token=("", V.anything()),  # the end-of-sequence token, for a tokenizer that sets none
    question_key=("", V.text()), answer_key=("", V.text()), max_prompt_len=(512, V.integer(1)),
    max_answer_len=(512, V.integer(1)), chat_template=(True, V.boolean()), system_prompt=("", V.text()),
    instruction=("Please reason step by step, and put your final answer within \\boxed{}.", V.text()),
    # rewards checked in worker processes (math): how many, and each check's hard time limit
    reward_workers=(default_workers(), V.integer(0)), reward_timeout=(5.0, V.positive()),
    # multi-turn tasks (tool_arithmetic, math_tools): the environment (empty: the task's own), model
    # turns per episode, how turn rewards combine, tokens per observation, the sandboxed tools'
    # time limit, processes and isolation (full: refuse a kernel without namespaces; weak: run
    # with a socket guard there, tools then able to read what the run's user can; docs/multiturn.md)
    env=("", V.text()), max_turns=(4, V.integer(1)), turn_reward=("last", V.one_of("sum", "last")),
    max_obs_tokens=(64, V.integer(1)), tool_timeout=(5.0, V.positive()), tool_workers=(1, V.integer(1)),
    tool_isolation=("full", V.one_of("full", "weak")),
    # agent: `module:function` of an async agent on the OpenAI client, playing `source`'s problems
    agent=("", V.text()), source=("tool_arithmetic", V.one_of(*SOURCES)),
    # every task: warn when every sample of the run's first this-many batches scored exactly 0 (0: never)
    zero_reward_steps=(20, V.integer(0)),
)
default_config = SECTION.config
RULES = SECTION.rules


def validate(c, hf_path: str = "") -> None:
    if c.name not in NAMES:
        raise ValueError(f"unknown task {c.name!r}; valid: {', '.join(NAMES)}")
    if c.name == "agent":  # task.agent is checked with the gateway section (run/config.py)
        return validate(source(c), hf_path)
    if c.name in MULTI_TURN:
        from jaxrl_llm.tasks import envs, math_tools, tool_arithmetic  # noqa: F401  (they register theirs)

        if c.env and c.env not in envs.names():
            raise ValueError(f"unknown task.env {c.env!r}; valid: {', '.join(envs.names())}")
    if c.name in ("math", "math_tools"):
        if not c.path:
            raise ValueError(f"task {c.name!r} reads a local dataset: set --config.task.path")
        if not (c.tokenizer or hf_path):
            raise ValueError(f"task {c.name!r} needs a tokenizer: set --config.model.hf_path (or --config.task.tokenizer)")
        if c.reward_timeout <= 0:
            raise ValueError("task.reward_timeout must be > 0 seconds")
        if c.eval_holdout >= 1.0:
            raise ValueError(f"task.eval_holdout={c.eval_holdout}: hold out a fraction of the training split below 1 "
                             "(e.g. 0.05)")
        if c.reward_workers < 1:
            raise ValueError(f"task {c.name!r} checks rewards in worker processes, whose timeout keeps a hung check "
                             f"from stopping the run: set --config.task.reward_workers >= 1 (got {c.reward_workers})")


def source(c):
    """The task section of the task `task.name=agent` plays (`task.source`)."""
    import ml_collections

    out = ml_collections.ConfigDict(c.to_dict())
    out.name = c.source
    return out


def make(c, hf_path: str = ""):
    """The task `c` names; for `agent`, the task its agents play (the run wraps it: gateway/agents.py)."""
    validate(c, hf_path)
    if c.name == "agent":
        return make(source(c), hf_path)
    if c.name == "arithmetic":
        from jaxrl_llm.tasks.arithmetic import Arithmetic

        return Arithmetic(digits=c.digits, ops=c.ops, eval_size=c.eval_size, reward_kind=c.reward, terms=c.terms,
                          scratchpad=c.scratchpad)
    turn = None
    if c.name in MULTI_TURN:
        from jaxrl_llm.tasks.multiturn import TurnConfig

        turn = TurnConfig(env=c.env or DEFAULT_ENV[c.name], max_turns=c.max_turns, turn_reward=c.turn_reward,
                          max_obs_tokens=c.max_obs_tokens, tool_timeout=c.tool_timeout, tool_workers=c.tool_workers,
                          tool_isolation=c.tool_isolation)
    if c.name == "tool_arithmetic":
        from jaxrl_llm.tasks import tool_arithmetic

        return tool_arithmetic.ToolArithmetic(digits=c.digits, ops=c.ops, eval_size=c.eval_size, terms=c.terms,
                                              turn=turn)
    from jaxrl_llm.models import load_tokenizer
    from jaxrl_llm.tasks.math_dataset import MathDataset
    from jaxrl_llm.tasks.math_tools import MathTools

    kw = dict(split=c.split, eval_split=c.eval_split, question_key=c.question_key, answer_key=c.answer_key,
              eval_size=c.eval_size, eval_holdout=c.eval_holdout, eval_holdout_seed=c.eval_holdout_seed,
              max_unparsed_gold=c.max_unparsed_gold, reward_workers=max(1, c.reward_workers),
              reward_timeout=c.reward_timeout, max_prompt_len=c.max_prompt_len, max_answer_len=c.max_answer_len,
              system_prompt=c.system_prompt, chat_template=c.chat_template)
    tokenizer = end_token(load_tokenizer(c.tokenizer or hf_path), c, hf_path)
    if c.name == "math_tools":  # the instruction names the tool (unless set on the command line)
        instruction = c.instruction if c.instruction != SECTION.fields["instruction"][0] else None
        return MathTools(c.path, tokenizer, turn=turn, **kw, **({"instruction": instruction} if instruction else {}))
    return MathDataset(c.path, tokenizer, instruction=c.instruction, **kw)


def end_token(tokenizer, c, hf_path: str):
    """`tokenizer` with an end-of-sequence token: its own, or `task.eos_token` (one token of its
    vocabulary); without one no completion could end, so that is refused, naming the key."""
    if c.eos_token:
        ids = tokenizer.convert_tokens_to_ids([c.eos_token])
        if ids[0] is None or (ids[0] == tokenizer.unk_token_id and c.eos_token != tokenizer.unk_token):
            raise ValueError(f"task.eos_token={c.eos_token!r} is not a token of the tokenizer's vocabulary "
                             f"({c.tokenizer or hf_path!r}); name one of its tokens, e.g. a special token: "
                             f"{', '.join(map(repr, tokenizer.all_special_tokens[:5])) or 'none'}")
        tokenizer.eos_token = c.eos_token
    if tokenizer.eos_token_id is None:
        key = "task.tokenizer" if c.tokenizer else "model.hf_path"
        raise ValueError(f"{key}={c.tokenizer or hf_path!r}: the tokenizer has no end-of-sequence token (eos_token "
                         "unset); set eos_token in its tokenizer_config.json, or --config.task.eos_token=<one of its "
                         "tokens>")
    return tokenizer


UNDECLARED_RANGE = (-1e6, 1e6)  # a task that declares no `reward_range`: finite, and far from fp32's limits


def reward_range(task) -> tuple:
    """(lowest, highest) reward a sample of `task` can get: its declared per-turn range, over
    every turn count for a multi-turn task that sums its turns."""
    lo, hi = getattr(task, "reward_range", UNDECLARED_RANGE)
    turn = getattr(task, "turn", None)
    if turn is not None and turn.turn_reward == "sum":
        lo, hi = min(lo, lo * turn.max_turns), max(hi, hi * turn.max_turns)
    return float(lo), float(hi)


def scorer(task, c) -> Scorer:
    """The scoring stage of `task` under its config section `c` (reward_workers, reward_timeout).
    A multi-turn task scores its episodes through its environment: no checker processes here."""
    return Scorer(task, 0 if c.name in MULTI_TURN else c.reward_workers, c.reward_timeout)


def score(task, prompts, tokens, mask, num_samples: int):
    """Rewards of a sampled batch scored in this thread (row i answers prompts[i // num_samples])
    and how many reward calls failed (raised, or returned a non-finite value); a failure scores
    0 and never stops the run."""
    return Scorer(task, background=False).score(prompts, tokens, mask, num_samples)
