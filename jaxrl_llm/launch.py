"""CLI: `python -m jaxrl_llm.launch --processes=N [--devices_per_process=K] -- MAIN FLAGS`, N local
processes of the main command (the launcher itself is `parallel/launch.py`)."""

import sys

from jaxrl_llm.parallel.launch import main

if __name__ == "__main__":
    sys.exit(main())
