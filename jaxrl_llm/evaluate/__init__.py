"""`python -m jaxrl_llm.evaluate`: a policy (a run's checkpoint or an HF directory) evaluated on a
task with `n` samples per problem (`docs/evaluation.md`).

  request     what to evaluate: settings, weights and samplers resolved; results written
  __main__    the command line

The samples, their scores and the estimators (pass@k, maj@k) are `tasks.evaluation` and
`tasks.estimators`, which training's scheduled evaluation shares. A command line entry point
beside `main` and `export`: it imports the run's config and plan helpers, the store
(checkpoints), the rollout backends and tasks; nothing in the core imports it.
"""
