"""The runtime: who samples with which policy version and when the learner sees it.

producer.py (draw, generate, score; batches or streamed groups with their origin), weights.py
(published versions), queue.py (bounded, version-aware), delay.py (network-delay models),
modes.py (the `Mode` interface, its registry, the sequential modes and the queue-fed
bookkeeping), async_mode.py (sampler threads and the async mode), orchestrator.py (trains on
what the mode hands over; run-long counters), position.py, admission.py, lengths.py (async
bookkeeping). The remote mode and sampler nodes live one floor up, in `jaxrl_llm.remote`, and
register their mode here.

It imports the rollout, `tasks`, `models`, `parallel` and the data contract; never the learner,
`remote/`, `store/` or `run/`.
"""

# The runtime's own modes register first, whatever imports this package: `modes.names()` (and
# every message listing them) keeps one order.
from jaxrl_llm.runtime import async_mode  # noqa: E402,F401
