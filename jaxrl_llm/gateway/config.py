"""The `gateway` section: where the agent gateway listens and how many sessions it plays at once
(`task.name=agent`; `docs/agents.md`)."""

from __future__ import annotations

from jaxrl_llm import validation as V

SECTION = V.Section(
    host=("127.0.0.1", V.text()),  # loopback; any other host needs the run's bearer token (always set)
    port=(0, V.integer(0)),  # 0: a free port, logged at start-up
    concurrency=(64, V.integer(1)),  # agent sessions in flight at once
    # agents in N worker processes (0: on a thread of the run's process); two rather than one: one
    # event loop's client work queued every session's next request behind the others' (bench_gateway)
    agent_processes=(2, V.integer(0)),
    session_timeout_s=(300.0, V.positive()),  # an idle session without a reward is dropped after this
    max_attempts=(3, V.integer(1)),  # a problem's dropped session is played again up to this many times
    # tokens an agent's first request may render to (its system prompt, tools' schemas; 0: as long
    # as the task's longest prompt, what an agent sending the problem as its one message needs)
    max_prompt_tokens=(0, V.integer(0)),
    # agents run elsewhere (other processes or machines): they take sessions from GET /rl/prompts and
    # post each reward; then `token` (the bearer key they send; redacted in records) and `port` are set
    external=(False, V.boolean()), token=("", V.text()),
)
default_config = SECTION.config
RULES = SECTION.rules
