"""The reward of the distillation-only arm: the exact match is kept in each sample's reward
(and so in rollout dumps), but the advantage reads ``none``, 0 for every sample, so GRPO's
part of the advantage is 0 and only the teacher's per-token term trains.

    rollout.reward=rewards:exact_match_unused algorithm.reward_key=none
    (with examples/distill/reverse on PYTHONPATH; compare.py sets it)
"""

from rl_rewards.qa import exact_match_reward


def exact_match_unused(response: str, label: object) -> dict[str, float]:
    return {"exact_match": exact_match_reward(response, label), "none": 0.0}
