"""Per-token policy, value and SFT losses.

Shapes: per-token tensors are padded ``[B, T]`` or packed ``[N]`` (then sequence-level
losses take ``cu_seqlens`` ``[B + 1]``). Log-probs are natural logs of the sampled
tokens. Every policy loss returns ``(per_token_loss, per_token_clipfrac)``, both of the
input shape, float32 (float64 when an input is float64: losses never narrow their inputs);
reduce them with :func:`aggregate` and the global denominators.
"""

from collections.abc import Callable

import torch

from rl_core import names
from rl_core._dtype import wide
from rl_core.aggregation import AGGREGATION_MODES, aggregate, row_sums_and_counts, segment_ids
from rl_core.registry import Registry

__all__ = [
    "AGGREGATION_MODES",
    "POLICY_LOSSES",
    "aggregate",
    "cispo_loss",
    "entropy_loss",
    "gspo_policy_loss",
    "ppo_policy_loss",
    "sft_loss",
    "value_loss",
]

# exp() of a log-ratio beyond this is clamped so masked garbage never yields inf·0 = NaN.
_MAX_LOG_RATIO = 20.0
_GSPO_MAX_SEQ_LOG_RATIO = 10.0


def _ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> torch.Tensor:
    log_ratio = (wide(log_probs) - wide(old_log_probs)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_ratio)


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float | None,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate given a (token or sequence-derived) ratio."""
    clip_high = clip_low if clip_high is None else clip_high
    advantages = wide(advantages)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).to(loss.dtype)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        lower_bound = -dual_clip * advantages
        loss = torch.where(advantages < 0, torch.minimum(loss, lower_bound), loss)
    return loss, clipfrac


def ppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate per token (also GRPO's and REINFORCE++'s loss).

    r = exp(log_probs - old_log_probs); loss = max(-A·r, -A·clip(r, 1-clip_low, 1+clip_high)).
    ``clip_high`` defaults to ``clip_low`` (set it higher for DAPO's clip-higher). With
    ``dual_clip`` c > 1, tokens with A < 0 take min(loss, -c·A). clipfrac is 1 where the
    clipped term is strictly larger than the unclipped one.
    """
    return _clipped_surrogate(
        _ratio(log_probs, old_log_probs), advantages, clip_low, clip_high, dual_clip
    )


def gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: a sequence-level ratio, applied per token so gradients flow through each token.

    log s_i = masked mean over sequence i of (log_probs - old_log_probs); token ratio =
    exp(min(sg(log s_i) + log_probs - sg(log_probs), 10)): value s_i (capped at e^10),
    gradient that of log_probs, and none through a capped sequence (verl's cap; without it
    a capped sequence with A < 0 would pass a gradient scaled by e^10). Clipped as in PPO.
    ``mask`` is ``[B, T]`` (or packed ``[N]`` with ``cu_seqlens``). Aggregated with
    ``seq-mean-token-mean`` (advantages constant over a sequence), the gradient is exactly
    that of the sequence-level objective.
    """
    lp = wide(log_probs)
    log_ratio = lp - wide(old_log_probs)
    sums, counts = row_sums_and_counts(log_ratio, mask, cu_seqlens)
    seq_log_ratio = (sums / counts.clamp(min=1.0)).detach()
    if cu_seqlens is None:
        per_token_seq_log_ratio = seq_log_ratio.unsqueeze(-1).expand_as(log_ratio)
    else:
        per_token_seq_log_ratio = seq_log_ratio[segment_ids(cu_seqlens, log_ratio.shape[0])]
    token_log_ratio = per_token_seq_log_ratio + (lp - lp.detach())
    ratio = torch.exp(token_log_ratio.clamp(max=_GSPO_MAX_SEQ_LOG_RATIO))
    return _clipped_surrogate(ratio, advantages, clip_low, clip_high, None)


def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: clipped importance weight as a constant, REINFORCE gradient on every token.

    loss = -sg(clip(r, 1-clip_low, 1+clip_high)) · A · log_probs; clipfrac marks tokens
    whose ratio fell outside the clip range.
    """
    ratio = _ratio(log_probs, old_log_probs).detach()
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -clipped_ratio * wide(advantages) * wide(log_probs)
    clipfrac = (clipped_ratio != ratio).to(loss.dtype)
    return loss, clipfrac


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    *,
    clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss per token: 0.5·max((v-R)², (old_v + clip(v-old_v, ±clip) - R)²).

    Without ``clip`` it is 0.5·(v-R)². Returns ``(per_token_loss, per_token_clipfrac)``,
    clipfrac being 1 where the clipped error is strictly the larger.
    """
    values, returns = wide(values), wide(returns)
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    old_values = wide(old_values)
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns).square()
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).to(loss.dtype)


def sft_loss(log_probs: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token; mask and aggregate it like any other loss."""
    return -wide(log_probs)


def entropy_loss(entropy: torch.Tensor) -> torch.Tensor:
    """Per-token entropy bonus as a loss (minimising it raises entropy): -entropy."""
    return -wide(entropy)


# Policy losses by name, with one signature so a trainer can pick one from its config:
# fn(log_probs, old_log_probs, advantages, mask, *, clip_low, clip_high, dual_clip, cu_seqlens)
PolicyLossFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
POLICY_LOSS_SHAPE = names.POLICY_LOSS_SHAPE  # torch-free in rl_core.names, as the registry
POLICY_LOSSES: Registry[PolicyLossFn] = names.POLICY_LOSSES


@POLICY_LOSSES.register("ppo")
def _ppo(log_probs, old_log_probs, advantages, mask, *, clip_low, clip_high, dual_clip, cu_seqlens):
    del mask, cu_seqlens
    return ppo_policy_loss(
        log_probs,
        old_log_probs,
        advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )


@POLICY_LOSSES.register("gspo")
def _gspo(
    log_probs, old_log_probs, advantages, mask, *, clip_low, clip_high, dual_clip, cu_seqlens
):
    del dual_clip
    clip_high = clip_low if clip_high is None else clip_high
    return gspo_policy_loss(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        cu_seqlens=cu_seqlens,
    )


@POLICY_LOSSES.register("cispo")
def _cispo(
    log_probs, old_log_probs, advantages, mask, *, clip_low, clip_high, dual_clip, cu_seqlens
):
    del mask, dual_clip, cu_seqlens
    clip_high = clip_low if clip_high is None else clip_high
    return cispo_loss(log_probs, old_log_probs, advantages, clip_low=clip_low, clip_high=clip_high)
