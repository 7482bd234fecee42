"""An OpenAI-compatible gateway in front of the sampler's slots: agents written against a chat
client are trained on exactly the tokens the sampler drew for them (`docs/agents.md`).

  chat      messages <-> token ids through the chat template; tool-call parsing
  responses OpenAI's Responses API (items) as chat turns, and answers as responses
  fields    what a request may ask of a turn, checked field by field, no I/O
  sessions  the session protocol (extend, branch, reward, timeout), no I/O
  service   sessions' rows in the continuous-batching slots; closed sessions as batch rows
  server    the HTTP face (FastAPI / uvicorn)
  agents    `task.name=agent`: agents' sessions as a task's rows
  tally     `gateway/*` metrics; in remote mode, the sum of the nodes' gateways
  embedded  the embedded calculator task's ids as a chat format

It imports the rollout (the slots), tasks (formats, environments' rewards) and the batch
contract; the run imports it. Never the learner, the runtime or the store.
"""
