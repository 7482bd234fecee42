"""Jackpot with a rollout actor smaller than the policy (Jackpot §4): the actor samples, the
policy is trained through OBRS on the actor's tokens, and the actor is trained jointly with
its own PPO loss plus a distillation KL towards the policy (Eq. 6-7). Both start from the
task's supervised warm start; the actor is three quarters as wide.

    python -m jaxrl_llm.main --config=configs/jackpot_small_actor.py --workdir=runs/jackpot_actor

With real checkpoints: --config.model.hf_path=/ckpt/Qwen3-1.7B --config.aux_model.hf_path=/ckpt/Qwen3-0.6B
"""

from configs import jackpot


def get_config(arg: str = ""):
    c = jackpot.get_config()
    # ~45% of the policy's parameters (policy: hidden 64, 2 layers, 4 heads of 16).
    c.aux_model.update(dict(hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                        head_dim=12))
    c.objective.jackpot.distill_coef = 1.0  # lambda_distill (Eq. 8)
    return c
