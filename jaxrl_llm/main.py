"""CLI: python -m jaxrl_llm.main --config=configs/default.py --workdir=runs/x [--config.a.b=v ...]

This file only parses flags; `experiment.main` does the rest.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jaxrl_llm import validation
from jaxrl_llm.run import experiment

CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "experiment config file")
WORKDIR = flags.DEFINE_string("workdir", "runs/default", "metrics, checkpoints; resumed if present")
VERBOSE = flags.DEFINE_bool("verbose", False, "print a start-up refusal with its traceback")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
    sys.exit(validation.cli(lambda: experiment.main(CONFIG.value, WORKDIR.value), VERBOSE.value, "jaxrl_llm.main"))


if __name__ == "__main__":
    app.run(main)
