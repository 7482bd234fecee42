"""Sampler nodes on other machines: the remote mode and everything between it and the nodes.

mode.py (`runtime.mode="remote"`: the learner's side, registered with the runtime's modes when
this package is imported), hub.py (sessions, leases and the checks every group passes),
leases.py (lease bookkeeping, no I/O), wire.py (the Arrow formats and their bounds),
service.py (the Arrow Flight service), client.py (the node's client), throttle.py (token
buckets) and node.py (the node, `python -m jaxrl_llm.sampler_node`).

It imports the runtime (producer, queue, weights, admission, modes), the rollout, `tasks`,
`models` and the data contract; never the learner, `store/` or `run/`.
"""

from jaxrl_llm.remote import mode  # noqa: F401  registers the remote mode
