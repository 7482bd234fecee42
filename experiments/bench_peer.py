"""jaxrl_llm against Hugging Face TRL's GRPOTrainer on one shared setup (not a test).

    pip install -e ".[peer]"          # TRL; or a venv of its own: --peer_python PATH
    python experiments/bench_peer.py [--steps 40] [--json experiments/results/bench_peer_cpu.json]

The shared setup, written to a temporary directory: the embedded default's tiny Qwen2 model,
warm-started here on 2-digit addition and exported in Hugging Face format; a character
tokenizer equal to the embedded task's (its chat template renders "<bos>" + the question); a
local jsonl of those problems ("37+48=", "#### 85"). Both trainers load that directory and
train with matched geometry: `--prompts` prompts x `--group` samples per batch, completions of
at most 4 tokens at temperature 1, `--updates` optimizer updates per batch (TRL:
`steps_per_generation`), no KL term, learning rate 1e-4, `--steps` batches.

Three rewards, each the same function of the completion on both sides:
  embedded   the arithmetic task's exact match (ours: task=arithmetic; TRL: a Python function);
  math       math-verify against the dataset's gold answer (ours: task=math, scored by its
             scoring stage; TRL: math_verify.parse/verify per completion, as its docs show);
  table      a precomputed table of right answers (the scoring-free bound).
jaxrl_llm runs in sync and async mode (one sampler thread). Trained tokens/s counts completion
tokens trained, from the 4th batch on (compilation and warm-up excluded on both sides);
`reward` is the mean training reward over the last 10 batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WARMUP = 3  # batches excluded from the timing
REWARDS = ("embedded", "math", "table")


# ------------------------------------------------------------------ the shared setup
def write_setup(path: str, problems: int = 2000) -> None:
    """The warm-started model in HF format, its tokenizer and the dataset, under `path`."""
    import jax
    import numpy as np
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from configs import default
    from jaxrl_llm.run import experiment
    from jaxrl_llm.models import hf
    from jaxrl_llm.tasks import arithmetic as A

    c = default.get_config()
    b = experiment.build(c)
    params = experiment.initial_params(c, None, b.model_cfg, b.task, jax.random.key(c.seed), b.greedy, [])
    vocab = {"<pad>": A.PAD, "<bos>": A.BOS, "<eos>": A.EOS, **A.VOCAB}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per character
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<pad>",  # no new token: the vocabulary is the task's
                                   padding_side="left")
    fast.chat_template = "{{ bos_token }}{{ messages[-1]['content'] }}"
    hf.save_params(path, params, b.model_cfg, fast)
    task, rng = b.task, np.random.default_rng(1)
    with open(os.path.join(path, "train.jsonl"), "w") as f:
        for _ in range(problems):
            q = A.decode(task.prompts(rng, 1)[0][1:])
            f.write(json.dumps({"question": q, "answer": f"#### {task.answer(A.encode(q))}"}) + "\n")


def problems(path: str):
    return [json.loads(line) for line in open(os.path.join(path, "train.jsonl"))]


# ------------------------------------------------------------------ jaxrl_llm
class TableTask:
    """The math task with its reward read from a table of right answers (no checker)."""

    def __init__(self, task, path: str):
        self._task = task
        right = {r["question"]: r["answer"].split("####")[1].strip() for r in problems(path)}
        self._want = {tuple(ids): right[task.tokenizer.decode(ids, skip_special_tokens=True)]
                      for ids, _ in task.train + task.held_out}

    def __getattr__(self, name):
        if name in ("checker", "check_args"):
            raise AttributeError(name)
        return getattr(self._task, name)

    def reward(self, prompt, completion) -> float:
        return float(self._task.completion_text(completion).strip() == self._want[tuple(prompt)])


def ours(path: str, mode: str, reward: str, a) -> dict:
    import jax
    import numpy as np

    from configs import default
    from jaxrl_llm.run import experiment
    from jaxrl_llm.tasks import scoring

    c = default.get_config()
    c.model.hf_path = path
    c.warm_start.steps = 0
    c.runtime.update(mode=mode, prompts_per_batch=a.prompts, num_samplers=1)
    c.sampler.num_samples, c.sampler.max_new_tokens = a.group, 4
    c.learner.num_minibatches = a.updates
    if a.sampler_devices:  # one CPU device per core; the samplers take the last ones (both modes)
        c.cpu_devices, c.runtime.sampler_devices = -1, a.sampler_devices
    c.train.steps = a.steps + WARMUP
    if reward != "embedded":
        c.task.update(name="math", path=os.path.join(path, "train.jsonl"), instruction="", eval_size=64,
                      eval_holdout=0.05, max_answer_len=4)
    b = experiment.build(c)
    orch = b.orchestrator
    if reward == "table":
        orch.producer.scorer = scoring.Scorer(TableTask(b.task, path))
    state = b.learner.init(jax.random.key(0), params=b.params)
    try:
        state, warm = orch.run(state, WARMUP)
        t = time.perf_counter()
        state, hist = orch.run(state, a.steps)
        wall = time.perf_counter() - t
    finally:
        b.scorer.close()
        orch.producer.scorer.close()
    tokens = sum(m["tokens_per_s"] * m["step_time_s"] for m in hist)
    s = orch.producer.scorer
    print(f"  scored in-process: {s.in_process}, in worker processes: {s.in_workers}", flush=True)
    return {"tokens_per_s": tokens / wall, "reward": float(np.mean([m["reward/mean"] for m in hist[-10:]])),
            "reward_start": float(warm[0]["reward/mean"]), "score_wait": float(hist[-1]["runtime/score_wait"]),
            "learner_idle": float(hist[-1]["runtime/learner_idle"])}


# ------------------------------------------------------------------ TRL (in the peer's python)
def trl_child(path: str, reward: str, a) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    rows = problems(path)
    gold = {r["question"]: r["answer"].split("####")[1].strip() for r in rows}
    data = Dataset.from_list([{"prompt": "<bos>" + r["question"], "question": r["question"]} for r in rows])
    counted = {"tokens": 0, "rewards": []}

    def count(completions, rewards):
        counted["tokens"] += sum(len(tok(c, add_special_tokens=False)["input_ids"]) + 1 for c in completions)
        counted["rewards"].append(sum(rewards) / len(rewards))
        return rewards

    def embedded(completions, question, **_):
        return count(completions, [float(c.strip() == gold[q]) for c, q in zip(completions, question)])

    def math(completions, question, **_):
        from math_verify import parse, verify

        return count(completions, [float(bool(got := parse(c)) and verify(parse(gold[q]), got))
                                   for c, q in zip(completions, question)])

    def table(completions, question, **_):
        return count(completions, [float(c.strip() == gold[q]) for c, q in zip(completions, question)])

    class Clock(TrainerCallback):
        marks = []

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % a.updates == 0:  # a generation batch fully trained
                self.marks.append((time.perf_counter(), counted["tokens"]))

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    rows_per_batch = a.prompts * a.group
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=rows_per_batch // a.updates,
                     gradient_accumulation_steps=1, steps_per_generation=a.updates, num_generations=a.group,
                     max_completion_length=4, temperature=1.0, learning_rate=1e-4, beta=0.0,
                     max_steps=(a.steps + WARMUP) * a.updates, logging_steps=10**6, save_strategy="no",
                     report_to="none", use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs={"embedded": embedded, "math": math, "table": table}[reward],
                          args=cfg, train_dataset=data, processing_class=tok, callbacks=[Clock()])
    trainer.train()
    (t0, n0), (t1, n1) = Clock.marks[WARMUP - 1], Clock.marks[-1]
    return {"tokens_per_s": (n1 - n0) / (t1 - t0), "reward": sum(counted["rewards"][-10:]) / 10,
            "reward_start": counted["rewards"][0]}


def trl(path: str, reward: str, a) -> dict:
    out = tempfile.mktemp(suffix=".json")
    cmd = [a.peer_python, os.path.abspath(__file__), "--trl_child", reward, "--setup", path, "--out", out,
           "--steps", str(a.steps), "--prompts", str(a.prompts), "--group", str(a.group), "--updates", str(a.updates)]
    subprocess.run(cmd, check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    return json.load(open(out))


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--updates", type=int, default=2)
    ap.add_argument("--rewards", default=",".join(REWARDS))
    ap.add_argument("--repeats", type=int, default=2, help="runs of each side, alternating; medians reported")
    ap.add_argument("--sampler_devices", type=int, default=0,
                    help="on CPU: one device per core, this many for the samplers (runtime.sampler_devices)")
    ap.add_argument("--peer_python", default=sys.executable, help="a python with trl installed")
    ap.add_argument("--setup", default="", help="an existing shared-setup directory (default: written here)")
    ap.add_argument("--trl_child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_child:
        json.dump(trl_child(a.setup, a.trl_child, a), open(a.out, "w"))
        return
    import numpy as np

    import common
    from jaxrl_llm.run import xla

    if a.sampler_devices:
        xla.set_cpu_devices(-1)

    path = a.setup or tempfile.mkdtemp(prefix="bench_peer_")
    if not a.setup:
        write_setup(path)
    res = {**common.cpu_kind(), "cores": os.cpu_count(), "sampler_devices": a.sampler_devices, "steps": a.steps,
           "prompts": a.prompts, "group": a.group, "updates_per_batch": a.updates}
    suffix = {"embedded": "", "math": "_math", "table": "_table"}
    runs = {}  # (side, reward) -> [results], sides alternating so that drifts in machine load hit all
    for _ in range(a.repeats):
        for reward in a.rewards.split(","):
            for side in ("trl", "sync", "async"):
                got = trl(path, reward, a) if side == "trl" else ours(path, side, reward, a)
                runs.setdefault((side, reward), []).append(got)
                print(f"{side:5s} {reward:8s} {got['tokens_per_s']:8.0f} tokens/s reward {got['reward']:.3f}"
                      + (f" score_wait {got['score_wait']:.3f}" if side != "trl" else ""), flush=True)
    for (side, reward), got in runs.items():  # medians over the repeats
        for k in got[0]:
            res[f"{side}{suffix[reward]}_{k}"] = float(np.median([g[k] for g in got]))
        if side != "trl":
            ratios = [g["tokens_per_s"] / p["tokens_per_s"] for g, p in zip(got, runs[("trl", reward)])]
            res[f"{side}_vs_trl{suffix[reward]}"] = float(np.median(ratios))
            res[f"{side}_vs_trl{suffix[reward]}_range"] = [min(ratios), max(ratios)]
    if "math" in a.rewards:
        res["async_vs_sync_math"] = res["async_math_tokens_per_s"] / res["sync_math_tokens_per_s"]
    common.report(res, a.json)


if __name__ == "__main__":
    main()
