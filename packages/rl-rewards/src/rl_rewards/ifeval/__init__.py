"""Verifiable instruction-following checks (IFEval style) and the ``ifeval`` reward."""

from rl_rewards.ifeval.checkers import CHECKERS, check_instruction

__all__ = ["CHECKERS", "check_instruction"]
