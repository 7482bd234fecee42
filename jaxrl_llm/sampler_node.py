"""CLI: `python -m jaxrl_llm.sampler_node --learner=HOST:PORT ...`, a sampler node (the node
itself is `remote/node.py`; `--help` lists its flags)."""

from jaxrl_llm.remote.node import main

if __name__ == "__main__":
    raise SystemExit(main())
