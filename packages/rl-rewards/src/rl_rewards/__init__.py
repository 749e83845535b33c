"""rl-rewards: reward functions and verifiers for RL post-training and eval pipelines.

No torch, no sibling packages: ``get_reward(name)`` returns ``fn(response, label) -> float``;
``score_batch`` scores many samples in worker processes with a per-sample timeout.
"""

from rl_rewards.registry import RewardSpec, get_reward, list_rewards, register_reward

__all__ = ["RewardSpec", "get_reward", "list_rewards", "register_reward"]
__version__ = "0.1.0"
