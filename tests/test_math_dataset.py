"""Math-dataset task: local loading in every supported layout, chat-template prompts,
math-verify rewards (a fast path held to math-verify's verdict, worker processes with a hard
per-sample timeout), and an end-to-end run on a tiny HF model."""

import json
import random
import time

import numpy as np
import pytest

from jaxrl_llm import models, tasks
from jaxrl_llm.tasks import math_dataset
from jaxrl_llm.tasks.pool import WorkerPool
from tests import checkers, hf_fixtures

TRAIN = [("What is 12 + 60?", "12 + 60 = 72\n#### 72"),
         ("Half of 1?", "It is $\\frac{1}{2}$, so the answer is \\boxed{\\frac{1}{2}}."),
         ("Sum of 1,000 and 234?", "#### 1,234"),
         ("Three times 3?", "#### 9")]
TEST = [("What is 5 + 5?", "#### 10"), ("What is 2 * 4?", "#### 8")]


@pytest.mark.parametrize("completion,gold,want", [
    ("12 + 60 = 72, so the answer is \\boxed{72}.", "72", 1.0),
    ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),      # symbolic, not string, equality
    ("We get $x = 9$.", "9", 1.0),
    ("first 3, then 72", "72", 1.0),                           # last number without a box
    ("I think it is 71.", "72", 0.0),
    ("no idea", "72", 0.0),
    ("\\boxed{1234}", math_dataset.gold_answer("so #### 1,234"), 1.0),
    ("\\boxed{\\frac{1}{2}}", math_dataset.gold_answer("thus \\boxed{\\frac{2}{4}}"), 1.0),  # MATH solution
])
def test_math_verify_scores_handwritten_answers(completion, gold, want):
    assert math_dataset.score(completion, gold) == want


def test_gold_answer_extraction():
    assert math_dataset.gold_answer("step\n#### 1,234 ") == "1234"
    assert math_dataset.gold_answer(" \\boxed{3} ") == "\\boxed{3}"


def _random_completion(rng: random.Random, gold: str) -> str:
    """Text shaped like model output: numbers, boxed answers, LaTeX and words, in any order."""
    def num():
        return str(rng.choice([rng.randint(0, 120), -rng.randint(1, 50), rng.randint(0, 99999)]))
    pieces = ["so", "the answer is", "=", "+", "apples", "$", ".", ",", "%", "x", "-", "\\frac{1}{2}", "\n", ":",
              "1,000", "3.5", "^2", "/2", "\\times", "\\%", "\\text{ apples}", "(", ")", gold, f"\\boxed{{{gold}}}"]
    parts = []
    for _ in range(rng.randint(0, 6)):
        r = rng.random()
        if r < 0.35:
            parts.append(num())
        elif r < 0.55:
            parts.append(f"\\boxed{{{rng.choice([num(), ' ' + num() + ' ', num() + '.5', 'x', gold])}}}")
        else:
            parts.append(rng.choice(pieces))
    if rng.random() < 0.3:
        parts = [rng.choice([num(), gold])]
    return rng.choice([" ", "", "\n"]).join(parts) + rng.choice(["", ".", " "])


def test_fast_path_agrees_with_math_verify():
    """Wherever the fast path decides, its reward is math-verify's; it decides the plain cases."""
    rng = random.Random(0)
    decided = 0
    for _ in range(1500):
        gold = rng.choice(["72", "-5", "0", "1234", "7", "3.5", "\\frac{1}{2}"])
        completion = _random_completion(rng, gold)
        fast = math_dataset.fast_score(completion, math_dataset.gold_int(gold))
        if fast is not None:
            decided += 1
            assert fast == math_dataset.score(completion, gold), (completion, gold)
    assert decided > 300
    assert math_dataset.fast_score("72.", 72) == 1.0 and math_dataset.fast_score("so \\boxed{ -5 }", -5) == 1.0
    assert math_dataset.fast_score("\\boxed{72}%", 72) is None  # math-verify reads a percentage
    assert math_dataset.fast_score("\\boxed{7} or \\boxed{72}", 72) is None
    assert math_dataset.fast_score("72", None) is None  # a non-integer gold answer: math-verify decides


def test_worker_pool_times_out_one_item_and_finishes_the_group():
    pool = WorkerPool(workers=2, timeout=1.0)
    t = time.monotonic()
    group = [(0.0, 1.0), (30.0, 2.0), (0.0, 3.0)]  # the middle check hangs
    other = pool.submit(checkers.sleep_then, [(0.0, 4.0)])
    assert pool.map(checkers.sleep_then, group) == [(1.0, None), (0.0, "timeout"), (3.0, None)]
    assert other.result() == [(4.0, None)]
    assert time.monotonic() - t < 25 and pool.timeouts == 1
    value, error = pool.call(int, "x")
    assert value == 0.0 and error.startswith("ValueError") and pool.errors == 1
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(abs, [(-1,)])
    with pytest.raises(ValueError, match="timeout must be > 0"):
        WorkerPool(1, timeout=0)
    with pytest.raises(ValueError, match="at least 1 worker"):
        WorkerPool(0)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_chat_model")
    tok = hf_fixtures.make_tokenizer(str(d), corpus=[q + " " + a for q, a in TRAIN + TEST])
    hf_fixtures.save(hf_fixtures.make_hf_model("qwen2_tied", vocab=len(tok)), str(d))
    return d


def _task(path, tokenizer_dir, **kw):
    c = tasks.default_config()
    c.update(dict(name="math", path=str(path), eval_size=8, reward_timeout=10.0), **kw)
    return tasks.make(c, str(tokenizer_dir))


def test_layouts_splits_and_chat_template(tokenizer_dir, tmp_path):
    import datasets

    # 1. a directory of parquet files split by name (a local copy of a hub dataset repo)
    d = tmp_path / "gsm8k" / "main"
    d.mkdir(parents=True)
    for split, rows in (("train", TRAIN), ("test", TEST)):
        datasets.Dataset.from_dict({"question": [q for q, _ in rows], "answer": [a for _, a in rows]}).to_parquet(
            str(d / f"{split}-00000-of-00001.parquet"))
    task = _task(tmp_path / "gsm8k", tokenizer_dir)
    assert len(task.train) == 4 and len(task.held_out) == 2
    assert [g for _, g in task.held_out] == ["10", "8"]
    text = task.tokenizer.decode(task.eval_prompts()[0])
    assert text.startswith("<|im_start|>user\nWhat is 5 + 5?\nPlease reason step by step")
    assert text.endswith("<|im_start|>assistant\n")
    assert task.eval_set == {"split": "test", "problems": 2}
    # 2. one jsonl file: no test split, refused (see the holdout test)
    with pytest.raises(ValueError, match="no 'test' split"):
        _task(_write_jsonl(tmp_path / "train.jsonl", TRAIN), tokenizer_dir, eval_size=1)
    # 3. save_to_disk with a DatasetDict, non-default column names
    dd = datasets.DatasetDict({s: datasets.Dataset.from_dict({"problem": [q for q, _ in r], "solution": [a for _, a in r]})
                               for s, r in (("train", TRAIN), ("test", TEST))})
    dd.save_to_disk(str(tmp_path / "saved"))
    task = _task(tmp_path / "saved", tokenizer_dir, chat_template=False)
    assert task.tokenizer.decode(task.eval_prompts()[1]).startswith("Question: What is 2 * 4?")
    rng = np.random.default_rng(0)
    assert all(tuple(p) in {tuple(ids) for ids, _ in task.train} for p in task.prompts(rng, 16))


def test_long_prompts_skipped_and_bad_inputs_explained(tokenizer_dir, tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", TRAIN + [("x " * 400, "#### 1")])
    task = _task(path, tokenizer_dir, max_prompt_len=128, eval_size=1, eval_holdout=0.2)
    assert len(task.train) + len(task.held_out) == 4 and task.max_prompt_len <= 128
    with pytest.raises(ValueError, match="no question column found .* columns: q, answer; set --config.task.question_key"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"q": "a", "answer": "b"}) + "\n")
        _task(bad, tokenizer_dir, eval_split="train")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _task(tmp_path / "nowhere", tokenizer_dir)
    with pytest.raises(ValueError, match="set --config.task.path"):
        tasks.validate(_cfg(name="math"), "x")
    with pytest.raises(ValueError, match="set --config.model.hf_path"):
        tasks.validate(_cfg(name="math", path="p"), "")
    with pytest.raises(ValueError, match="unknown task 'gsm8k'; valid: arithmetic, math"):
        tasks.validate(_cfg(name="gsm8k"), "")


def _cfg(**kw):
    c = tasks.default_config()
    c.update(kw)
    return c


def test_rewards_through_the_scorer_and_failures_counted(tokenizer_dir, tmp_path):
    """Groups go to the worker processes unless the fast path decides; rewards equal the
    in-thread ones; a check that overruns scores 0 and is counted, never raised."""
    task = _task(_write_jsonl(tmp_path / "train.jsonl", TRAIN), tokenizer_dir, eval_size=1, eval_holdout=0.25)
    half, seventy_two = list(task.train[1][0]), list(task.train[0][0])  # golds \\frac{1}{2} and 72
    enc = lambda s: task.tokenizer(s, add_special_tokens=False)["input_ids"] + [task.eos_id]
    texts = ["so \\boxed{72}", "so \\boxed{73}", "it is 72 or \\boxed{72} and \\boxed{72}", "nothing",
             "\\boxed{\\frac{2}{4}}", "\\boxed{0.5}", "\\boxed{1/3}", "1/2"]
    rows = [enc(t) for t in texts]
    width = max(map(len, rows))
    tokens = np.array([r + [task.pad_id] * (width - len(r)) for r in rows])
    mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows], bool)
    prompts = [seventy_two, half]
    assert isinstance(task.check_args(seventy_two, rows[0]), float)  # the fast path
    assert task.check_args(half, rows[4]) == ("\\boxed{\\frac{2}{4}}", TRAIN[1][1])  # the whole MATH solution
    want = [1, 0, float(math_dataset.score(texts[2], "72")), 0, 1, 1, 0, 1]
    assert tasks.score(task, prompts, tokens, mask, 4) == (pytest.approx(want), 0)
    scorer = tasks.scorer(task, _cfg(reward_workers=2, reward_timeout=20.0))
    scored = scorer.submit(prompts, tokens, mask, 4)
    assert scored.result()[0].tolist() == want and scored.result()[1] == 0
    scorer.pool.timeout, task.checker = 0.5, checkers.hang  # every check now overruns: scored 0 and counted
    rewards, failures = scorer.score(prompts, tokens, mask, 4)
    assert rewards.tolist() == [1, 0, 0, 0, 0, 0, 0, 0] and failures == 6  # the fast-path rows still score
    scorer.close()
    with pytest.raises(ValueError, match="reward_workers >= 1"):
        tasks.validate(_cfg(name="math", path="p", reward_workers=0), "tok")


def test_end_to_end_on_a_local_hf_model_and_dataset(tokenizer_dir, tmp_path):
    from jaxrl_llm.run import experiment
    from tests.test_experiment import _tiny

    c = _tiny("ppo")
    c.task.update(dict(name="math", path=str(_write_jsonl(tmp_path / "train.jsonl", TRAIN)), eval_size=2,
                       max_answer_len=8, eval_holdout=0.5))
    c.model.hf_path = str(tokenizer_dir)
    summary = experiment.run(c, str(tmp_path / "run"), log=lambda *_: None)
    assert summary["version"] == 2 and summary["reward_failures"] == 0
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert sum("loss" in r for r in records) == 2 and sum("eval/reward" in r for r in records) == 3
    held = json.load(open(tmp_path / "run" / "eval_set.json"))
    assert held["split"] == "train" and len(held["rows"]) == 2 and held["problems"] == 2
    evals = [r for r in records if "eval/reward" in r]
    assert all(r["eval_set"] == "train, 2 rows held out (0.5 with seed 0)" and r["eval/problems"] == 2 for r in evals)


def test_a_tokenizer_without_an_end_token_is_refused_naming_the_key(tokenizer_dir, tmp_path):
    from jaxrl_llm.models import load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir))
    tok.eos_token = None
    tok.save_pretrained(tmp_path / "no_eos")
    path = _write_jsonl(tmp_path / "train.jsonl", TRAIN)
    with pytest.raises(ValueError, match=rf"^task.tokenizer='{tmp_path}/no_eos': the tokenizer has no end-of-sequence"):
        _task(path, tokenizer_dir, tokenizer=str(tmp_path / "no_eos"), eval_holdout=0.25)


def _hf_config(tokenizer_dir, tmp_path):
    from tests.test_experiment import _tiny

    c = _tiny("ppo")
    c.task.update(dict(name="math", path=str(_write_jsonl(tmp_path / "train.jsonl", TRAIN)), eval_size=2,
                       max_answer_len=8, eval_holdout=0.5))
    c.model.hf_path = str(tokenizer_dir)
    return c


def test_hf_checkpoint_in_bfloat16_samples_with_bf16_weights(tokenizer_dir, tmp_path):
    """model.dtype applies to a loaded checkpoint: float32 master weights train, the samplers
    hold (and decode with) a bfloat16 copy and a bfloat16 KV cache."""
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.run import experiment

    c = _hf_config(tokenizer_dir, tmp_path)
    c.model.dtype = "bfloat16"
    b = experiment.build(c)
    assert b.model_cfg.dtype == "bfloat16" and b.orchestrator.sampler.cfg.cache_dtype == "bfloat16"
    state = b.learner.init(jax.random.key(0), params=b.params)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("float32")}
    orch = b.orchestrator
    state, hist = orch.run(state, 1)
    version, weights = orch.store.latest()
    assert version == 1 and {x.dtype for x in jax.tree.leaves(weights)} == {np.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype("float32")}
    assert np.isfinite(hist[-1]["loss"]) and hist[-1]["mismatch/abs_logp_max"] < 0.1  # bf16 sampler vs fp32 learner


def test_a_plan_beyond_the_memory_available_fails_at_start_up(tokenizer_dir, tmp_path, monkeypatch):
    from jaxrl_llm.run import experiment, memory
    from jaxrl_llm.run import plan as plan_lib

    c = _hf_config(tokenizer_dir, tmp_path)
    plan = memory.total(memory.estimate(c, tasks.make(c.task, c.model.hf_path),
                                        plan_lib.model_cfg(c.model, tasks.make(c.task, c.model.hf_path))))
    monkeypatch.setattr(memory, "available", lambda: (plan // 2, "host RAM"))
    loaded = []
    monkeypatch.setattr(models, "load_params", lambda *a, **k: loaded.append(a))  # what run/parts.py calls
    with pytest.raises(MemoryError, match=r"memory plan needs .* GiB but host RAM offers .*learner_params.*"
                                          r"--config.model.remat=full .*--config.learner.num_minibatches=4"):
        experiment.run(c, str(tmp_path / "run"), log=lambda *_: None)
    assert not loaded and not (tmp_path / "run" / "checkpoints").exists()  # nothing built or loaded
    c.train.check_memory = False
    monkeypatch.undo()
    monkeypatch.setattr(memory, "available", lambda: (plan // 2, "host RAM"))
    b = experiment.build(c)  # the escape hatch
    assert b.memory_plan["learner_params"] == 4 * b.model_cfg.num_params


def test_lora_on_a_local_hf_checkpoint_references_it_and_resumes_only_on_it(tokenizer_dir, tmp_path):
    """LoRA in bfloat16 on a checkpoint directory: the workdir names the directory (no copy),
    resumes on it, and refuses the same path once its weights changed."""
    import os
    import shutil

    from jaxrl_llm.run import experiment
    from jaxrl_llm.store import frozen_base

    base = str(tmp_path / "base")
    shutil.copytree(tokenizer_dir, base)
    c = _hf_config(base, tmp_path)
    c.model.update(dict(hf_path=base, dtype="bfloat16"))
    c.model.lora.rank = 4
    run = str(tmp_path / "run")
    assert experiment.run(c, run, log=lambda *_: None)["version"] == 2
    rec = frozen_base.read(run)
    assert rec["path"] == base and rec["hf_path"] == base and not os.path.exists(os.path.join(run, frozen_base.COPY))
    c.train.steps = 3
    assert experiment.run(c, run, log=lambda *_: None)["version"] == 3
    params, cfg = models.load_params(base)
    params["final_norm"]["scale"] = params["final_norm"]["scale"] * 1.5
    models.save_params(base, params, cfg)
    c.train.steps = 4
    with pytest.raises(ValueError, match=rf"different LoRA base: .*trained on {base} .*this run's base is {base}"):
        experiment.run(c, run, log=lambda *_: None)


def test_no_test_split_is_refused_and_a_held_out_fraction_is_seeded_disjoint_and_recorded(tokenizer_dir, tmp_path):
    """A dataset without the evaluation split is refused, naming the splits it has and both ways
    out; `task.eval_holdout` holds out round(f * n) training rows, disjoint from training, the
    same rows for the same seed, and the run records them: a resume whose held-out rows moved
    (here: the dataset grew) is refused, naming the record."""
    import datasets

    from jaxrl_llm.store import workdir

    dd = datasets.DatasetDict({s: datasets.Dataset.from_dict({"question": [q for q, _ in r], "answer": [a for _, a in r]})
                               for s, r in (("train", TRAIN), ("validation", TEST))})
    dd.save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match=r"has no 'test' split to evaluate on \(splits found: train, validation\); "
                                         r"set --config.task.eval_split .* --config.task.eval_holdout=0.05"):
        _task(tmp_path / "saved", tokenizer_dir)
    assert _task(tmp_path / "saved", tokenizer_dir, eval_split="validation").eval_set["split"] == "validation"
    rows = [(f"What is {i} + 1?", f"#### {i + 1}") for i in range(40)]
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    a, b = (_task(path, tokenizer_dir, eval_holdout=0.1, eval_size=64) for _ in range(2))
    c = _task(path, tokenizer_dir, eval_holdout=0.1, eval_size=64, eval_holdout_seed=1)
    held = a.eval_set["rows"]
    assert len(held) == 4 and held == sorted(held) and held == b.eval_set["rows"] != c.eval_set["rows"]
    golds = lambda pairs: sorted(int(g) for _, g in pairs)  # noqa: E731
    assert golds(a.held_out) == [r + 1 for r in held]
    assert golds(a.train) == [r + 1 for r in range(40) if r not in held]
    assert a.eval_set == {"split": "train", "holdout": 0.1, "seed": 0, "rows": held, "problems": 4}
    run = tmp_path / "run"
    run.mkdir()
    assert workdir.check_eval_set(str(run), a.eval_set, resumed=False) == ""
    assert workdir.check_eval_set(str(run), b.eval_set, resumed=True) == ""
    grown = _task(_write_jsonl(tmp_path / "train.jsonl", rows * 2), tokenizer_dir, eval_holdout=0.1, eval_size=64)
    refusal = workdir.check_eval_set(str(run), grown.eval_set, resumed=True)
    assert refusal.startswith(f"{run}/eval_set.json: the run being resumed evaluated on split 'train', rows {held}")


def test_gold_answers_nothing_parses_are_refused_above_the_limit_and_dropped_below(tokenizer_dir, tmp_path):
    """Answers without '####' in a format math-verify cannot read score every sample 0; they are
    counted at start-up, refused beyond task.max_unparsed_gold naming rows, dropped below it."""
    rows = [(f"What is {i} + 1?", f"#### {i + 1}") for i in range(20)]
    rows[3] = ("Name it?", "the answer is a secret")
    rows[11] = ("And this?", "see the worked solution above")
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(ValueError, match=r"2 of 20 gold answers \(10.0%\) cannot be parsed \(more than "
                                         r"task.max_unparsed_gold=0.01\).*'train' row 3: 'the answer is a secret'; "
                                         r"'train' row 11: "):
        _task(path, tokenizer_dir, eval_split="train")
    task = _task(path, tokenizer_dir, eval_holdout=0.25, max_unparsed_gold=0.2)
    assert sum(task.eval_set["dropped_unparsed_gold"].values()) == 2
    assert any(w.startswith("dropped 2 of 20 problems whose gold answers cannot be parsed") for w in task.warnings)
    assert len(task.train) + len(task.held_out) == 18
    assert all(g.isdigit() for _, g in task.train + task.held_out)


def test_the_fast_gold_check_agrees_with_math_verify():
    """`gold.plain` decides only answers math-verify parses; the rest go to it."""
    from jaxrl_llm.tasks import gold

    answers = ["72", "-3", "1.5", "3/4", "so \\boxed{12}.", "\\boxed{\\frac{1}{2}}", "x = 2", "no answer", "",
               "\\boxed{}", "\\boxed{ }", "1,234", "see above", "\\boxed{\\text{(C)}}", "\\boxed{@@}",
               "\\boxed{(1, 2]}", "\\boxed{\\frac{1}{}}", "x^{3}"]
    for a in answers:
        if gold.plain(a):
            assert gold.parses(a), a
    assert gold.unparsed(answers, workers=1, timeout=10.0) == [i for i, a in enumerate(answers) if not gold.parses(a)]
    assert {answers[i] for i in gold.unparsed(answers, workers=1, timeout=10.0)} >= {"no answer", "", "see above"}


def test_an_eos_token_named_in_the_config_is_accepted_and_a_foreign_one_refused(tokenizer_dir, tmp_path):
    from jaxrl_llm.models import load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir))
    end = tok.eos_token
    tok.eos_token = None
    tok.save_pretrained(tmp_path / "no_eos")
    path = _write_jsonl(tmp_path / "train.jsonl", TRAIN)
    task = _task(path, tokenizer_dir, tokenizer=str(tmp_path / "no_eos"), eval_holdout=0.25, eos_token=end)
    assert task.eos_id == tok.convert_tokens_to_ids(end)
    with pytest.raises(ValueError, match=r"^task.eos_token='<not a token>' is not a token of the tokenizer"):
        _task(path, tokenizer_dir, tokenizer=str(tmp_path / "no_eos"), eval_holdout=0.25, eos_token="<not a token>")


def test_final_answers_for_the_majority_vote():
    """maj@k votes on the last boxed answer (braces balanced), else on a bare number."""
    from jaxrl_llm.tasks.math_dataset import final_answer

    assert final_answer("so \\boxed{\\frac{1}{2}} then \\boxed{ 7 }") == "7"
    assert final_answer("x = \\boxed{\\frac{1}{ 2}}.") == "\\frac{1}{2}"
    assert final_answer(" 72. ") == "72" and final_answer("-3") == "-3"
    assert final_answer("no answer") is None and final_answer("\\boxed{12") is None
    assert final_answer("\\boxed{ }") is None
