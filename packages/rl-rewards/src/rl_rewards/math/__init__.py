"""Math answer verification: extraction, LaTeX normalisation, symbolic/numeric equivalence."""

from rl_rewards.math.equivalence import is_equivalent
from rl_rewards.math.extract import extract_answer, last_boxed

__all__ = ["extract_answer", "is_equivalent", "last_boxed"]
