"""The run's reward: an rl-rewards name or a dotted path, called per sample.

The reward sees the response decoded without special tokens (an EOS is not part of the
answer) and the sample's label. A reward that raises either stops the run with the
reward's name, the sample and the error (``on_error="raise"``: :class:`RewardError`,
``rl-train`` exits with status 2), or (``on_error="skip"``) marks the sample aborted with
the error in its metadata, so its group is left out of training, and counts it in
``num_errors``; never a silent 0.
"""

import logging
from typing import Any

from rl_core.types import Sample, SampleStatus

logger = logging.getLogger(__name__)
ON_ERROR = ("raise", "skip")


class RewardError(RuntimeError):
    """A reward function raised on a sample."""


class Reward:
    """``reward(sample) -> float | dict`` of one reward function (see the module docstring)."""

    def __init__(self, name: str, score, tokenizer: Any, *, on_error: str = "raise"):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}; choose one of {ON_ERROR}")
        self.name, self.score, self.tokenizer, self.on_error = name, score, tokenizer, on_error
        self.num_errors = self.total_errors = 0

    def __call__(self, sample: Sample) -> float | dict:
        response_ids = sample.tokens[sample.prompt_length :]
        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        try:
            return self.score(text, sample.label)
        except Exception as error:  # re-raised with context or counted, never swallowed
            message = (
                f"reward {self.name!r} raised on sample {sample.index} "
                f"(response {text!r}, label {sample.label!r}): {type(error).__name__}: {error}"
            )
            if self.on_error == "raise":
                raise RewardError(message) from error
        self.num_errors, self.total_errors = self.num_errors + 1, self.total_errors + 1
        if self.total_errors <= 10:
            logger.warning("%s; sample skipped (rollout.on_reward_error=skip)", message)
        sample.status = SampleStatus.ABORTED
        sample.metadata["reward_error"] = message
        return 0.0

    def take_error_count(self) -> int:
        """Errors since the last call (for a per-step metric)."""
        count, self.num_errors = self.num_errors, 0
        return count


def load_reward(name: str, tokenizer: Any, *, on_error: str = "raise") -> Reward:
    """The reward ``name`` (rl-rewards registry or ``pkg.mod:fn``) as ``fn(sample)``."""
    from rl_rewards import get_reward

    return Reward(name, get_reward(name), tokenizer, on_error=on_error)
