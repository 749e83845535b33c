"""The unit of data that flows from rollout to training: :class:`Sample`."""

import json
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any


class SampleStatus(StrEnum):
    """Where a sample is in its life. Aborted and truncated samples are kept, never dropped
    silently: the buffer decides what to do with them."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"  # hit the length limit
    ABORTED = "aborted"  # generation stopped early (weight update, over-sampling, error)


@dataclass(kw_only=True)
class Sample:
    """One generated response to one prompt, with everything training needs.

    ``tokens`` holds prompt then response token ids; the last ``response_length`` of them
    are the response. ``loss_mask`` (length ``response_length``) is 1 on tokens the policy
    produced and 0 on tokens it did not (tool outputs in a multi-turn rollout).
    ``rollout_log_probs`` (length ``response_length``) are the engine's log-probs of the
    response tokens. ``weight_versions`` lists the weight version of every engine that
    generated part of the response (several after a partial rollout resumed).
    """

    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] | None = None
    reward: float | dict[str, float] | None = None
    status: SampleStatus = SampleStatus.PENDING
    rollout_log_probs: list[float] | None = None
    weight_versions: list[str] = field(default_factory=list)
    group_index: int | None = None
    index: int | None = None
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.status = SampleStatus(self.status)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def effective_loss_mask(self) -> list[int]:
        """The loss mask, defaulting to every response token."""
        return [1] * self.response_length if self.loss_mask is None else self.loss_mask

    def validate(self) -> None:
        """Raise ValueError when the token bookkeeping does not add up."""
        if not 0 <= self.response_length <= len(self.tokens):
            raise ValueError(
                f"sample {self.index}: response_length {self.response_length} outside "
                f"0..{len(self.tokens)} tokens"
            )
        for name in ("loss_mask", "rollout_log_probs"):
            value = getattr(self, name)
            if value is not None and len(value) != self.response_length:
                raise ValueError(
                    f"sample {self.index}: {name} has {len(value)} entries for "
                    f"{self.response_length} response tokens"
                )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown Sample fields {unknown}; known: {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> "Sample":
        return cls.from_dict(json.loads(text))


def scalar_reward(
    sample: Sample, reward_key: str | None = None, *, unscored: float | None = None
) -> float:
    """The number ``sample.reward`` stands for: the reward itself, or its entry ``reward_key``
    when the reward is a mapping. A sample without a reward is a ValueError, unless
    ``unscored`` gives its value (a group filter or pass@k count aborted samples as 0)."""
    reward = sample.reward
    if reward is None:
        if unscored is not None:
            return unscored
        raise ValueError(
            f"sample {sample.group_index}/{sample.index} has no reward; score it first"
        )
    if isinstance(reward, dict):
        if reward_key not in reward:
            raise ValueError(
                f"the reward of sample {sample.index} is a mapping with keys "
                f"{sorted(map(str, reward))}; set reward_key (RolloutConfig.reward_key; with "
                f"rl-train, set algorithm.reward_key) to the one to use, not {reward_key!r}"
            )
        return float(reward[reward_key])
    return float(reward)
