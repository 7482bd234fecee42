"""Tasks: prompts + verifiable rewards.

A task has `prompts(rng, n)`, `eval_prompts()`, `reward(prompt_ids, completion_ids)`, and
`eos_id`, `pad_id`, `vocab_size`, `prompt_buckets`, `max_answer_len`; tasks with
`supervised(rng, n)` can warm-start a tiny model; `close()`, if present, is called at the end.
Embedded: `arithmetic` (no download). From a local dataset: `math` (GSM8K / MATH style,
math-verify reward).
"""

from __future__ import annotations

from jaxrl_llm import validation as V
from jaxrl_llm.tasks.scoring import Scorer, default_workers

NAMES = ("arithmetic", "math")


SECTION = V.Section(  # every task's fields, so any of them can be set from the command line
    name=("arithmetic", V.one_of(*NAMES)), eval_size=(128, V.integer(1)),
    # arithmetic (reward: exact | digits, partial credit per answer position); difficulty:
    # digits per operand, operators, operands per problem, running results written first
    digits=(2, V.integer(1)), ops=("+", V.text()), reward=("exact", V.one_of("exact", "digits")),
    terms=(2, V.integer(2)), scratchpad=(False, V.boolean()),
    # math: a local dataset path; the tokenizer comes from model.hf_path unless `tokenizer` is set (paths.py)
    path=("", V.anything()), tokenizer=("", V.anything()), split=("train", V.text()), eval_split=("test", V.text()),
    question_key=("", V.text()), answer_key=("", V.text()), max_prompt_len=(512, V.integer(1)),
    max_answer_len=(512, V.integer(1)), chat_template=(True, V.boolean()), system_prompt=("", V.text()),
    instruction=("Please reason step by step, and put your final answer within \\boxed{}.", V.text()),
    # rewards checked in worker processes (math): how many, and each check's hard time limit
    reward_workers=(default_workers(), V.integer(0)), reward_timeout=(5.0, V.positive()),
)
default_config = SECTION.config
RULES = SECTION.rules


def validate(c, hf_path: str = "") -> None:
    if c.name not in NAMES:
        raise ValueError(f"unknown task {c.name!r}; valid: {', '.join(NAMES)}")
    if c.name == "math":
        if not c.path:
            raise ValueError("task 'math' reads a local dataset: set --config.task.path")
        if not (c.tokenizer or hf_path):
            raise ValueError("task 'math' needs a tokenizer: set --config.model.hf_path (or --config.task.tokenizer)")
        if c.reward_timeout <= 0:
            raise ValueError("task.reward_timeout must be > 0 seconds")
        if c.reward_workers < 1:
            raise ValueError("task 'math' checks rewards in worker processes, whose timeout keeps a hung check "
                             f"from stopping the run: set --config.task.reward_workers >= 1 (got {c.reward_workers})")


def make(c, hf_path: str = ""):
    validate(c, hf_path)
    if c.name == "arithmetic":
        from jaxrl_llm.tasks.arithmetic import Arithmetic

        return Arithmetic(digits=c.digits, ops=c.ops, eval_size=c.eval_size, reward_kind=c.reward, terms=c.terms,
                          scratchpad=c.scratchpad)
    from jaxrl_llm.models import load_tokenizer
    from jaxrl_llm.tasks.math_dataset import MathDataset

    return MathDataset(c.path, load_tokenizer(c.tokenizer or hf_path), split=c.split, eval_split=c.eval_split,
                       question_key=c.question_key, answer_key=c.answer_key, eval_size=c.eval_size,
                       max_prompt_len=c.max_prompt_len, max_answer_len=c.max_answer_len,
                       instruction=c.instruction, system_prompt=c.system_prompt,
                       chat_template=c.chat_template)


def scorer(task, c) -> Scorer:
    """The scoring stage of `task` under its config section `c` (reward_workers, reward_timeout)."""
    return Scorer(task, c.reward_workers, c.reward_timeout)


def score(task, prompts, tokens, mask, num_samples: int):
    """Rewards of a sampled batch scored in this thread (row i answers prompts[i // num_samples])
    and how many reward calls failed (raised, or returned a non-finite value); a failure scores
    0 and never stops the run."""
    return Scorer(task, background=False).score(prompts, tokens, mask, num_samples)
