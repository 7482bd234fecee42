"""CLI: `python -m jaxrl_llm.export --workdir=runs/x --out=DIR [--version=N] [--dtype=D] [--overwrite]`:
a full-weight run's policy as a Hugging Face checkpoint, or a LoRA run's adapters as a PEFT
directory (`--merged=DIR`: also the merged model); the export itself is `store/export.py`."""

import sys

from absl import app, flags

from jaxrl_llm.store.export import main

if __name__ == "__main__":
    flags.mark_flags_as_required(["workdir", "out"])
    sys.exit(app.run(main))
