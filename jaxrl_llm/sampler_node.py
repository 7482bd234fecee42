"""CLI: `python -m jaxrl_llm.sampler_node --learner=HOST:PORT ...`, a sampler node (the node
itself is `runtime/node.py`; `--help` lists its flags)."""

from jaxrl_llm.runtime.node import main

if __name__ == "__main__":
    raise SystemExit(main())
