"""The run's reward: an rl-rewards name or a dotted path, called per sample.

The reward sees the response decoded without special tokens (an EOS is not part of the
answer) and the sample's label. A reward that raises stops the run with the reward's name,
the sample and the error, rather than silently scoring 0.
"""

from collections.abc import Callable
from typing import Any

from rl_core.types import Sample


class RewardError(RuntimeError):
    """A reward function raised on a sample."""


def load_reward(name: str, tokenizer: Any) -> Callable[[Sample], float | dict]:
    """``fn(sample) -> reward`` of reward ``name`` (rl-rewards registry or ``pkg.mod:fn``)."""
    from rl_rewards import get_reward

    score = get_reward(name)

    def reward(sample: Sample) -> float | dict:
        response_ids = sample.tokens[sample.prompt_length :]
        text = tokenizer.decode(response_ids, skip_special_tokens=True)
        try:
            return score(text, sample.label)
        except Exception as error:  # re-raised with context, never swallowed
            raise RewardError(
                f"reward {name!r} raised on sample {sample.index} "
                f"(response {text!r}, label {sample.label!r}): {type(error).__name__}: {error}"
            ) from error

    return reward
