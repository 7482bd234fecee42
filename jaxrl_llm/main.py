"""CLI: python -m jaxrl_llm.main --config=configs/default.py --workdir=runs/x [--config.a.b=v ...]

Logic lives in jaxrl_llm/experiment.py; this file only parses flags.
"""

import signal
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jaxrl_llm import distributed, experiment

CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "experiment config file")
WORKDIR = flags.DEFINE_string("workdir", "runs/default", "metrics, checkpoints; resumed if present")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
    experiment.set_cpu_devices(CONFIG.value.cpu_devices)
    distributed.initialize(CONFIG.value.distributed)  # many processes, when asked; else a no-op
    summary = experiment.run(CONFIG.value, WORKDIR.value)
    if distributed.is_main():
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()})
    if "interrupted_by" in summary:  # saved and resumable: 130 after Ctrl-C, 143 after SIGTERM
        sys.exit(128 + signal.Signals[summary["interrupted_by"]].value)


if __name__ == "__main__":
    app.run(main)
