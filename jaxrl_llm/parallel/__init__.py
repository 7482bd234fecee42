"""Many devices and many processes: process start-up and collectives (`distributed`), the device
mesh and the logical-axis rules that shard params and batches (`sharding`), the agreed stop on a
preemption signal (`preemption`), and the local multi-process launcher (`launch`).

It imports only `validation` from this package (and JAX): every other layer may use it.
"""
