"""Math word problems (GSM8K / MATH style) from a local dataset, scored by math-verify.

The data is read with `datasets` from a local path, never a hub:
  * a directory written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`;
  * a .parquet / .jsonl / .json file (taken as the train split);
  * a directory of such files, split by file name prefix (`train-*.parquet`, `test.jsonl`),
    e.g. a local copy of the GSM8K or MATH repositories.
Questions go through the tokenizer's chat template (or a plain "Question/Answer" layout with
`chat_template=False`). The gold answer is the text after "####" (GSM8K) or the whole
solution (MATH; math-verify extracts its \\boxed{}); a completion is parsed the same way
(\\boxed{} first, then the last number or expression) and compared symbolically, in worker
processes with a per-sample timeout (`scoring.Scorer`). Where both answers are plain integers
(a bare number, or one \\boxed{} integer) the reward is decided in-process without sympy; a
test holds this fast path to math-verify's verdict.

Evaluation uses `eval_split`; a dataset without it is refused unless `eval_holdout` holds out a
seeded part of the training split (`splits.py`). Gold answers nothing can parse are found at
start-up (`gold.py`). docs/datasets.md lists every check.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
from typing import Optional, Sequence

import numpy as np

from jaxrl_llm.tasks import gold, splits

QUESTION_KEYS = ("question", "problem", "prompt", "query")
ANSWER_KEYS = ("answer", "solution", "final_answer", "gold")
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def gold_answer(text: str) -> str:
    """GSM8K answers end in '#### 72' (thousands separators allowed); anything else is kept
    whole for math-verify to extract from."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().replace(",", "")
    return text.strip()


def score(completion: str, gold: str) -> float:
    """1.0 when math-verify finds the completion's final answer equal to the gold answer.
    Runs inside a scoring process; timeouts are enforced from outside, hence None here."""
    from math_verify import parse, verify

    got = parse(completion, parsing_timeout=None)
    return float(bool(got) and verify(_parsed_gold(gold), got, timeout_seconds=None))


@functools.lru_cache(maxsize=1 << 16)
def _parsed_gold(gold: str):
    """Each problem's gold answer is parsed once per worker, not once per sample."""
    from math_verify import parse

    return parse(gold, parsing_timeout=None) or [gold]  # unparseable: an exact match of the final answer


_INT = re.compile(r"-?\d+")
_BARE = re.compile(r"\s*(-?\d+)\.?\s*")  # "72", "72." (a sentence's full stop)
_BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")


def final_answer(text: str) -> Optional[str]:
    """The last \\boxed{...} of `text` (braces balanced, whitespace dropped), else `text` when
    it is a bare number, else None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        bare = _BARE.fullmatch(text)
        return bare.group(1) if bare else None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return "".join(text[i + 1:j].split()) or None
    return None  # unclosed


def gold_int(gold: str) -> Optional[int]:
    return int(gold) if _INT.fullmatch(gold) else None


def fast_score(completion: str, gold: Optional[int]) -> Optional[float]:
    """math-verify's verdict where it is plain: an integer gold answer and a completion that is a
    bare integer or holds exactly one \\boxed{integer} (math-verify takes a boxed answer over
    any other number). None where math-verify has to decide."""
    if gold is None:
        return None
    bare = _BARE.fullmatch(completion)
    if bare:
        return float(int(bare.group(1)) == gold)
    if completion.count("\\boxed") == 1 and "%" not in completion:  # math-verify reads "72%" as 0.72 too
        boxed = _BOXED.search(completion)
        if boxed:
            return float(int(boxed.group(1)) == gold)
    return None


def load_split(path: str, split: str):
    """A `datasets.Dataset` for `split` from a local path, or None if that split is absent."""
    import datasets

    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset path {path!r} does not exist (datasets are read from local paths only)")
    if os.path.isdir(path) and (os.path.exists(os.path.join(path, "dataset_dict.json"))
                                or os.path.exists(os.path.join(path, "state.json"))):
        data = datasets.load_from_disk(path)
        if isinstance(data, datasets.DatasetDict):
            return data[split] if split in data else None
        return data if split == "train" else None
    if os.path.isfile(path):
        ext = os.path.splitext(path)[1]
        if ext not in FORMATS:
            raise ValueError(f"unsupported dataset file {path!r}; valid extensions: {', '.join(FORMATS)}")
        return _load_files(FORMATS[ext], [path], "train") if split == "train" else None
    for ext, fmt in FORMATS.items():
        files = sorted(glob.glob(os.path.join(path, "**", f"{split}*{ext}"), recursive=True))
        if files:
            return _load_files(fmt, files, split)
    return None


def split_names(path: str) -> list[str]:
    """The splits `load_split` finds under a local dataset path, by name."""
    if os.path.isfile(path):
        return ["train"]
    if os.path.exists(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json")) as f:
            return list(json.load(f).get("splits", []))
    if os.path.exists(os.path.join(path, "state.json")):
        return ["train"]
    return sorted({os.path.basename(f)[:-len(ext)].split("-")[0].split(".")[0] for ext in FORMATS
                   for f in glob.glob(os.path.join(path, "**", f"*{ext}"), recursive=True)})


def _load_files(fmt: str, files: list, split: str):
    """`datasets.load_dataset` over local files; files without a row (which `datasets` answers
    with a bare StopIteration) are refused by name."""
    import datasets

    empty = [f for f in files if os.path.getsize(f) == 0 or (fmt == "json" and not _has_text(f))]
    if empty:
        raise ValueError(f"task.path: the {split!r} split's file(s) {', '.join(empty)} hold no rows")
    try:
        return datasets.load_dataset(fmt, data_files={split: files}, split=split)
    except StopIteration:
        raise ValueError(f"task.path: the {split!r} split's files {', '.join(files)} hold no rows") from None


def _has_text(path: str) -> bool:
    with open(path, "rb") as f:
        return any(line.strip() for line in f)


def _check_text(data, column: str, path: str, split: str, key: str) -> None:
    """Every value of `column` is text: a numeric or nested question would be formatted as its
    Python repr, silently."""
    for i, value in enumerate(data[column]):
        if not isinstance(value, str):
            raise ValueError(f"task.path={path!r}: column {column!r} ({key}) of the {split!r} split must hold text; "
                             f"row {i} holds {type(value).__name__} {str(value)[:40]!r}")


def _splits(path: str, split: str, eval_split: str, holdout: float, seed: int):
    """(training rows, evaluation rows, the evaluation set's record, each set's row numbers in its
    split): the evaluation split, or with `holdout` a seeded fraction of the training split
    (`splits.py`)."""
    train = load_split(path, split)
    if train is None:
        raise ValueError(f"task.split={split!r} not found under task.path={path!r} (splits found: "
                         f"{', '.join(split_names(path)) or 'none'})")
    if len(train) == 0:
        raise ValueError(f"task.path={path!r}: the {split!r} split has no rows")
    if holdout:
        rows = splits.holdout_rows(len(train), holdout, seed)
        rest = np.setdiff1d(np.arange(len(train)), rows)
        record = {"split": split, "holdout": holdout, "seed": seed, "rows": rows.tolist()}
        return train.select(rest), train.select(rows), record, (rest, rows)
    held = load_split(path, eval_split)
    if held is None:
        raise ValueError(splits.missing(path, split, eval_split, split_names(path)))
    return train, held, {"split": eval_split}, (np.arange(len(train)), np.arange(len(held)))


def _parsed_only(path: str, data: tuple, names: tuple, rows: tuple, answer: str, limit: float, workers: int,
                 timeout: float, record: dict):
    """`data` (datasets; `rows`: their row numbers in the named splits) without the problems whose
    gold answer nothing can parse (`gold.py`), and a warning naming how many were dropped (counted
    in `record`); refused beyond `limit`."""
    golds = [[gold_answer(str(x)) for x in d[answer]] for d in data]
    flat = [g for gs in golds for g in gs]
    bad = gold.unparsed(flat, workers, timeout)
    if not bad:
        return data, ""
    starts = np.cumsum([0] + [len(gs) for gs in golds])
    where = [(int(np.searchsorted(starts, i, side="right")) - 1, i) for i in bad]
    examples = "; ".join(f"{names[d]!r} row {rows[d][i - starts[d]]}: {flat[i][:60]!r}" for d, i in where[:3])
    if len(bad) > limit * len(flat):
        raise ValueError(f"task.path={path!r}: {len(bad)} of {len(flat)} gold answers ({len(bad) / len(flat):.1%}) "
                         f"cannot be parsed (more than task.max_unparsed_gold={limit}), so their samples would all "
                         f"score 0; e.g. {examples}. Check task.answer_key ({answer!r}) and the answer format "
                         "(GSM8K: '#### <number>'; MATH: a \\boxed{} answer)")
    drop = [[i - starts[d] for d, i in where if d == k] for k in range(len(data))]
    record["dropped_unparsed_gold"] = dict(zip(("train", "eval"), (len(d) for d in drop)))  # by role
    kept = tuple(d.select(np.setdiff1d(np.arange(len(d)), gone)) for d, gone in zip(data, drop))
    return kept, (f"dropped {len(bad)} of {len(flat)} problems whose gold answers cannot be parsed "
                  f"(below task.max_unparsed_gold={limit}); e.g. {examples}")


def _pick(columns: Sequence[str], given: str, candidates: Sequence[str], what: str) -> str:
    if given:
        if given not in columns:
            raise ValueError(f"{what} column {given!r} not in the dataset; columns: {', '.join(columns)}")
        return given
    for c in candidates:
        if c in columns:
            return c
    raise ValueError(f"no {what} column found (looked for {', '.join(candidates)}); columns: {', '.join(columns)}; "
                     f"set --config.task.{what}_key")


class MathDataset:
    """Task protocol (see runtime/orchestrator.py) over a local math dataset."""

    reward_range = (0.0, 1.0)  # math-verify's verdict

    def __init__(self, path: str, tokenizer, split: str = "train", eval_split: str = "test",
                 question_key: str = "", answer_key: str = "", eval_size: int = 64,
                 max_prompt_len: int = 512, max_answer_len: int = 512, instruction: str = INSTRUCTION,
                 system_prompt: str = "", chat_template: bool = True, eval_holdout: float = 0.0,
                 eval_holdout_seed: int = 0, max_unparsed_gold: float = 0.01, reward_workers: int = 1,
                 reward_timeout: float = 5.0):
        self.tokenizer = tokenizer
        self.max_answer_len = max_answer_len
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; set --config.task.chat_template=False "
                             "for plain 'Question: ... Answer:' prompts")
        self._chat, self._instruction, self._system = chat_template, instruction, system_prompt
        self.warnings: list[str] = []  # said once at start-up (`experiment.run` logs them)
        train, held, self.eval_set, rows = _splits(path, split, eval_split, eval_holdout, eval_holdout_seed)
        q = _pick(train.column_names, question_key, QUESTION_KEYS, "question")
        a = _pick(train.column_names, answer_key, ANSWER_KEYS, "answer")
        for data, name in ((train, split), (held, self.eval_set["split"])):
            _check_text(data, q, path, name, "task.question_key")
        same = self.eval_set == {"split": split}  # evaluating on the training split: its rows checked once
        sets = ((train,), (split,), rows[:1]) if same else ((train, held), (split, self.eval_set["split"]), rows)
        kept, dropped = _parsed_only(path, *sets, a, max_unparsed_gold, reward_workers, reward_timeout, self.eval_set)
        train, held = kept * 2 if same else kept
        if dropped:
            self.warnings.append(dropped)
        if same:
            self.warnings.append(f"task.eval_split={split!r} is the training split: evaluation rewards are training "
                                 "figures (task.eval_holdout holds out a part of it instead)")
        self._text: dict = {}  # prompt ids -> the user message they render (`user_text`)
        self.train = self._encode(train[q], train[a], max_prompt_len)
        self.held_out = self._encode(held[q], held[a], max_prompt_len)
        if not self.train:
            raise ValueError(f"task.path={path!r}: none of the {len(train)} {split!r} problems fits "
                             f"task.max_prompt_len={max_prompt_len} tokens (raise it)")
        if len(self.held_out) < eval_size:
            self.warnings.append(f"task.eval_size={eval_size} but the {self.eval_set['split']!r} evaluation set holds "
                                 f"{len(self.held_out)} usable problems: evaluating on all {len(self.held_out)}")
        self.held_out = self.held_out[:eval_size]
        self.eval_set["problems"] = len(self.held_out)
        self._gold = {tuple(ids): (g, gold_int(g)) for ids, g in self.train + self.held_out}
        longest = max(len(ids) for ids, _ in self.train + self.held_out)
        self.prompt_buckets = tuple(b for b in (64, 128, 256, 512, 1024, 2048) if b < longest) + (longest,)

    @property
    def chat_template(self) -> bool:
        """Prompts rendered by the tokenizer's chat template (else "Question: ... Answer:")."""
        return self._chat

    def user_text(self, prompt: Sequence[int]) -> str:
        """The user message a prompt renders (the question, then the instruction)."""
        return self._text[tuple(prompt)]

    def _format(self, question: str) -> list[int]:
        text = f"{question}\n{self._instruction}".strip()
        if not self._chat:
            return self.tokenizer(f"Question: {text}\nAnswer:", add_special_tokens=True)["input_ids"]
        msgs = ([{"role": "system", "content": self._system}] if self._system else []) + [
            {"role": "user", "content": text}]
        ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _encode(self, questions, answers, max_len: int):
        out = []
        for question, answer in zip(questions, answers):
            ids = self._format(str(question))
            if len(ids) <= max_len:  # longer prompts are skipped, not truncated mid-question
                out.append((ids, gold_answer(str(answer))))
                self._text[tuple(ids)] = f"{question}\n{self._instruction}".strip()
        return out

    # -- task protocol
    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self.eos_id if pad is None else pad

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def max_prompt_len(self) -> int:
        return self.prompt_buckets[-1]

    def prompts(self, rng: np.random.Generator, n: int) -> list[list[int]]:
        return [list(self.train[i][0]) for i in rng.integers(0, len(self.train), n)]

    def eval_prompts(self) -> list[list[int]]:
        return [list(ids) for ids, _ in self.held_out]

    def completion_text(self, completion: Sequence[int]) -> str:
        return self.tokenizer.decode(list(completion), skip_special_tokens=True)

    def final_answer(self, completion: Sequence[int]) -> Optional[str]:
        """The answer a completion gives, for maj@k's vote: its last \\boxed{...} (whitespace
        dropped), else the completion itself when it is a bare number; None otherwise."""
        return final_answer(self.completion_text(completion))

    # -- scoring (scoring.Scorer): the fast path here, math-verify in worker processes
    checker = staticmethod(score)
    checker_imports = ("math_verify",)
    checker_warmup = ("so \\boxed{\\frac{1}{2}}", "0.5")  # math-verify builds its LaTeX parser on first use

    def check_args(self, prompt: Sequence[int], completion: Sequence[int]):
        """The reward when the fast path decides it, else the args of one `score` call."""
        text, (gold, as_int) = self.completion_text(completion), self._gold[tuple(prompt)]
        fast = fast_score(text, as_int)
        return (text, gold) if fast is None else fast

    def reward(self, prompt: Sequence[int], completion: Sequence[int]) -> float:
        """In this thread, with no timeout; runs score through `scoring.Scorer`."""
        args = self.check_args(prompt, completion)
        return score(*args) if isinstance(args, tuple) else args
