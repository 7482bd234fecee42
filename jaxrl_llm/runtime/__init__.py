"""The runtime: who samples with which policy version and when the learner sees it.

queue.py (bounded, version-aware), weights.py (published versions), delay.py (network-delay
models), orchestrator.py (the training modes), async_mode.py (sampler threads and the learner
loop of the async mode).
"""
