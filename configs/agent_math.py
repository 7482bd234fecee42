"""A local math dataset on a local chat model (say GSM8K on Qwen2.5-0.5B-Instruct), played by
`examples/calculator_agent.py`: the stock OpenAI client with a calculator tool of its own. The
gateway renders each session with the tokenizer's chat template; the dataset's check scores the
model's turns (docs/agents.md, "A local dataset with a chat model").

    python -m jaxrl_llm.main --config=configs/agent_math.py --workdir=runs/agent_math \
        --config.task.path=/data/gsm8k --config.model.hf_path=/models/Qwen2.5-0.5B-Instruct
"""

from configs import default


def get_config(arg: str = "ppo"):
    c = default.get_config(arg)
    c.task.update(dict(name="agent", source="math", agent="examples.calculator_agent:agent", max_turns=4))
    c.gateway.max_prompt_tokens = 1024  # the calculator's schema joins the rendered system prompt
    c.warm_start.steps = 0  # a chat model answers in the task's format already
    c.sampler.num_samples = 8
    c.runtime.prompts_per_batch = 16
    c.learner.lr = 1e-6
    c.train.update(dict(steps=200, eval_every=20, save_every=50))
    return c
