"""The learner: its sharded state (`train_state`), the pure jitted step (`update`) over
minibatches (`minibatches`) and packed rows (`packing`), the forward passes it needs (`forward`),
the metrics a step reports (`step_metrics`), and `learner.Learner`, which builds and runs it.

It imports `objectives`, `models`, `parallel`, `batch`, `staleness` and `validation`, never the
runtime, the rollout or `run/`.
"""
