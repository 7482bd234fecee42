"""CLI: `python -m jaxrl_llm.export --workdir=runs/x --out=DIR [--merged=DIR] [--version=N]`,
a LoRA run's adapters as a PEFT directory (the export itself is `store/export.py`)."""

import sys

from absl import app, flags

from jaxrl_llm.store.export import main

if __name__ == "__main__":
    flags.mark_flags_as_required(["workdir", "out"])
    sys.exit(app.run(main))
