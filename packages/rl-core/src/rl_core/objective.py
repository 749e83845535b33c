"""The full RL training loss of one micro-batch: policy loss, KL to the reference, entropy
bonus and rollout importance correction, aggregated with the step's global denominators.

Backends call this with the tensors they computed; it reads no config object. Every value
in the returned metrics is this micro-batch's share of the step-wide mean (computed with
the same global denominators), so summing metrics over micro-batches and data-parallel
ranks gives the step's metric.
"""

import torch

from rl_core.aggregation import aggregate
from rl_core.kl import approx_kl
from rl_core.losses import POLICY_LOSSES, entropy_loss, sft_loss


def policy_objective(
    *,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_name: str = "ppo",
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "low_var_kl",
    importance_weights: torch.Tensor | None = None,
    agg_mode: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    norm_length: float | None = None,
    tensor_metrics: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss = agg(pg · w) + kl_coef · agg(kl) - entropy_coef · agg(entropy).

    ``agg`` is :func:`rl_core.aggregation.aggregate` with ``agg_mode`` and the denominators;
    the metric ``pg/clipfrac`` is always the fraction of valid tokens clipped (token-mean
    over ``num_tokens``, as verl reports it), whatever ``agg_mode`` the loss uses.

    Shapes: every per-token tensor ``[B, T]`` (or packed ``[N]`` with ``cu_seqlens``).
    ``importance_weights`` (e.g. from :func:`rl_core.importance.rollout_importance_weights`)
    multiply the per-token policy loss. Returns ``(loss, metrics)``; metrics are Python
    floats, or detached 0-d tensors with ``tensor_metrics`` (no device read-back: a
    trainer sums them over micro-batches and reads them once per step).
    """
    value = _detached if tensor_metrics else _as_float
    policy_loss_fn = POLICY_LOSSES.get(loss_name)
    pg_loss, clipfrac = policy_loss_fn(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        cu_seqlens=cu_seqlens,
    )
    if importance_weights is not None:
        pg_loss = pg_loss * importance_weights

    def agg(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate(
            per_token,
            mask,
            mode=agg_mode,
            cu_seqlens=cu_seqlens,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            norm_length=norm_length,
        )

    loss = agg(pg_loss)
    clipped_tokens = aggregate(clipfrac, mask, cu_seqlens=cu_seqlens, num_tokens=num_tokens)
    metrics = {"loss/pg": value(loss), "pg/clipfrac": value(clipped_tokens)}
    if ref_log_probs is not None and kl_coef != 0.0:
        kl_term = agg(approx_kl(log_probs, ref_log_probs, kind=kl_kind))
        loss = loss + kl_coef * kl_term
        metrics["loss/kl"] = value(kl_term)
    if entropy is not None:
        entropy_term = agg(entropy)
        if entropy_coef != 0.0:
            loss = loss + entropy_coef * agg(entropy_loss(entropy))
        metrics["actor/entropy"] = value(entropy_term)
    metrics["loss/total"] = value(loss)
    return loss, metrics


def _as_float(tensor: torch.Tensor) -> float:
    return float(tensor.detach())


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach()


def sft_objective(
    *,
    log_probs: torch.Tensor,
    mask: torch.Tensor,
    agg_mode: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    norm_length: float | None = None,
    tensor_metrics: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Supervised fine-tuning: aggregated negative log-likelihood of the masked tokens
    (metrics as in :func:`policy_objective`)."""
    loss = aggregate(
        sft_loss(log_probs),
        mask,
        mode=agg_mode,
        cu_seqlens=cu_seqlens,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_length=norm_length,
    )
    value = _detached(loss) if tensor_metrics else _as_float(loss)
    return loss, {"loss/sft": value, "loss/total": value}
