"""Multi-turn embedded task: products of three 2-digit numbers with a calculator tool.

The model writes "<calc>37*48</calc>", the sandboxed calculator's value is appended to its row as
an observation (loss 0, version -1), and it goes on until it answers and ends with <eos>; reward 1
when the answer is the product. Warm-started on traces that call the tool (their observations
carry no loss either), then trained asynchronously with continuous batching: a row waiting on
the tool frees its decode slot. No downloads.

    python -m jaxrl_llm.main --config=configs/tool_arithmetic.py --workdir=runs/tool_arithmetic
"""

from configs import default


def get_config(arg: str = "a3po"):
    c = default.get_config(arg)
    c.task.update(dict(name="tool_arithmetic", digits=2, ops="*", terms=3, max_turns=4, turn_reward="last",
                       max_obs_tokens=8, tool_timeout=2.0, tool_workers=1))
    c.sampler.batching = "continuous"
    c.sampler.num_samples = 8
    c.runtime.prompts_per_batch = 16
    c.learner.num_minibatches = 2
    c.warm_start.target = 0.2
    c.train.update(dict(steps=300, eval_every=50, save_every=100))
    return c
