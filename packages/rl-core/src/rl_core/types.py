"""The unit of data that flows from rollout to training: :class:`Sample`."""

import json
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


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
    ``routed_experts`` (MoE models, when the rollout asked for them) are the experts the
    engine sent each token to, ``[<= len(tokens) - 1, layers, top_k]`` integers
    (:mod:`rl_core.routing`); the trainer's routers replay them.
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
    routed_experts: "torch.Tensor | None" = None

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
        routes = self.routed_experts
        if routes is not None and (
            routes.dim() != 3 or routes.shape[0] >= max(len(self.tokens), 1)
        ):
            raise ValueError(
                f"sample {self.index}: routed_experts {tuple(routes.shape)} must be "
                f"[<= {len(self.tokens) - 1} tokens, layers, top_k]"
            )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        if self.routed_experts is not None:  # JSON-safe: shape and SGLang's base64 ids
            from rl_core.routing import encode_routes

            shape = list(self.routed_experts.shape)
            data["routed_experts"] = {"shape": shape, "ids": encode_routes(self.routed_experts)}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown Sample fields {unknown}; known: {sorted(known)}")
        routes = data.get("routed_experts")
        if isinstance(routes, dict):
            from rl_core.routing import decode_routes

            _, num_layers, top_k = routes["shape"]
            routes = decode_routes(routes["ids"], num_layers=num_layers, top_k=top_k)
            data = {**data, "routed_experts": routes}
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
