"""`python -m jaxrl_llm.evaluate`: a policy (a run's checkpoint or an HF directory) evaluated on a
task with `n` samples per problem (`docs/evaluation.md`).

  estimators  pass@k (Chen et al. 2021's unbiased estimator), maj@k, response lengths
  sampled     samples drawn through a rollout backend, scored, summarised
  request     what to evaluate: settings, weights and samplers resolved; results written
  __main__    the command line

A command line entry point beside `main` and `export`: it imports the run's config and plan
helpers, the store (checkpoints), the rollout backends and tasks; nothing in the core imports it.
"""
