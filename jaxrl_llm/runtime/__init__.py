"""The runtime: who samples with which policy version and when the learner sees it.

producer.py (draw, generate, score; batches or streamed groups with their origin), weights.py
(published versions), queue.py (bounded, version-aware), delay.py (network-delay models),
modes.py (the sequential modes), async_mode.py (sampler threads and the async mode),
orchestrator.py (trains on what the mode hands over; run-long counters), position.py,
admission.py, lengths.py (async bookkeeping); the sampler-node service: hub.py, leases.py,
wire.py, service.py, client.py, throttle.py, remote.py (the mode) and node.py (the node).

It imports the rollout, `tasks`, `models`, `parallel` and the data contract; never the learner,
`store/` or `run/`.
"""
