"""The research harness: staleness sweeps, the papers' claims in miniature, reports and
statistics over finished runs. It imports the core (`jaxrl_llm.run.experiment` and below); the core
never imports it (tests/test_imports.py holds the contract)."""
