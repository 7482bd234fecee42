"""One experiment from config to summary: the config and its validation (`config`), the resolved
plan of a run (`plan`), the memory plan (`memory`), local paths (`paths`), the metrics writers
(`metrics`), and `experiment`, which builds the parts, resumes, trains, evaluates and saves.

The top of the core: it may import every package but `research/`, and nothing in the core
imports it (`main` and the research harness do).
"""
