"""CLI: evaluate a policy on a task with `n` samples per problem (`request.py`):

    python -m jaxrl_llm.evaluate --workdir=runs/x [--version=N] [--n=16 --k=1,4,16] [--out=DIR]
    python -m jaxrl_llm.evaluate --hf_path=DIR --out=DIR [--config=configs/x.py --config.task.path=...]

Reports mean reward, pass@k, maj@k (tasks with an extractable answer), the greedy reward,
response lengths and truncation in `<out>/eval.json` and `<out>/eval.md`.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jaxrl_llm import validation
from jaxrl_llm.evaluate import request

CONFIG = config_flags.DEFINE_config_file("config", None, "a config for the task and sampling settings (default: "
                                         "the run's own, else the embedded arithmetic task)")
WORKDIR = flags.DEFINE_string("workdir", "", "a run's workdir: evaluate its newest checkpoint (or --version)")
VERSION = flags.DEFINE_integer("version", None, "the checkpoint version (default: the newest)")
HF_PATH = flags.DEFINE_string("hf_path", "", "a Hugging Face model directory to evaluate instead of a run")
N = flags.DEFINE_integer("n", 8, "samples per problem")
K = flags.DEFINE_list("k", ["1", "2", "4", "8"], "pass@k and maj@k for these k (those <= n)")
TEMPERATURE = flags.DEFINE_float("temperature", None, "sampling temperature (default: the config's)")
TOP_P = flags.DEFINE_float("top_p", None, "nucleus mass (default: the config's)")
TOP_K = flags.DEFINE_integer("top_k", None, "top-k truncation, 0 off (default: the config's)")
MAX_NEW = flags.DEFINE_integer("max_new_tokens", 0, "new tokens per sample (default: the config's)")
GREEDY = flags.DEFINE_bool("greedy", True, "also report the greedy reward")
SPLIT = flags.DEFINE_string("split", "", "a dataset task's split to evaluate on (default: the config's)")
SIZE = flags.DEFINE_integer("size", 0, "problems to evaluate (default: the config's task.eval_size)")
SEED = flags.DEFINE_integer("seed", 0, "the sampling seed")
CHUNK = flags.DEFINE_integer("chunk", 64, "problems per generate call")
SUCCESS = flags.DEFINE_float("success", None, "a sample succeeds at this reward (default: the task's highest)")
OUT = flags.DEFINE_string("out", "", "where eval.json and eval.md go (default: <workdir>/eval/v<version>)")
OVERWRITE = flags.DEFINE_bool("overwrite", False, "replace an existing eval.json")
VERBOSE = flags.DEFINE_bool("verbose", False, "print a refusal with its traceback")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO

    def body() -> int:
        ks = tuple(int(k) for k in K.value)
        req = request.Request(workdir=WORKDIR.value, version=VERSION.value, hf_path=HF_PATH.value, n=N.value, ks=ks,
                               temperature=TEMPERATURE.value, top_p=TOP_P.value, top_k=TOP_K.value,
                               max_new_tokens=MAX_NEW.value, greedy=GREEDY.value, split=SPLIT.value, size=SIZE.value,
                               seed=SEED.value, chunk=CHUNK.value, success=SUCCESS.value, out=OUT.value,
                               overwrite=OVERWRITE.value)
        r = request.evaluate(req, CONFIG.value)
        shown = " ".join(f"{k}={v:.3f}" for k, v in r.items() if k == "reward" or k.startswith(("pass@", "maj@", "greedy")))
        print(f"{r['source']}: {r['problems']} problems, {shown}; wrote {r['out']}")
        return 0

    return validation.cli(body, VERBOSE.value, "jaxrl_llm.evaluate")


if __name__ == "__main__":
    sys.exit(app.run(main))
