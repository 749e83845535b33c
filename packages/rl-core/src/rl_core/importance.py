"""Train/rollout mismatch correction: importance weights of the trainer's old policy
against the log-probs the rollout engine reported for the same tokens.

Engines (bf16 kernels, other batching) and the trainer never agree exactly, and in
asynchronous loops the rollout policy is older than the trainer's. Multiplying the
per-token loss by these weights corrects for it.

Shapes: ``[B, T]`` with ``mask``, or packed ``[N]`` with ``cu_seqlens`` ``[B + 1]`` for
sequence-level weights. Weights are detached float32 (float64 for float64 inputs) of the
input shape, 0 on masked tokens.

- ``mode="truncate"`` (TIS): w = min(ratio, cap).
- ``mode="mask"`` (MIS): w = ratio where lower <= ratio <= cap, else 0 (token dropped).
- ``level="sequence"``: the ratio is exp(sum of the sequence's log-ratios), shared by
  every token of that sequence.

:func:`off_policy_sequence_mask` (OPSM, DeepSeek-V3.2; slime's ``--use-opsm``) drops the
policy loss of sequences with a negative advantage whose policy drifted too far from the
one that sampled them.
"""

import torch

from rl_core._dtype import wide
from rl_core.aggregation import row_sums_and_counts, segment_ids
from rl_core.names import IS_LEVELS, IS_MODES

_MAX_LOG_RATIO = 20.0


def rollout_importance_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    cap: float = 2.0,
    lower: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    tensor_metrics: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights pi_old / pi_rollout and the metrics users watch.

    Returns ``(weights, metrics)`` (metrics as Python floats, or as detached 0-d tensors
    with ``tensor_metrics``); metrics: ``mismatch/abs_log_ratio_mean`` (mean
    |Δ log-prob| over valid tokens), ``mismatch/frac_capped`` (fraction of valid tokens
    whose weight was truncated or masked), ``mismatch/weight_mean``.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"unknown IS level {level!r}; choose one of: {', '.join(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown IS mode {mode!r}; choose one of: {', '.join(IS_MODES)}")
    if cap <= 0:
        raise ValueError(f"cap must be positive, got {cap}")
    log_ratio = wide(old_log_probs) - wide(rollout_log_probs)
    weights_mask = mask.to(log_ratio.dtype)
    log_ratio = log_ratio * weights_mask
    if level == "sequence":
        seq_log_ratio, _ = row_sums_and_counts(log_ratio, weights_mask, cu_seqlens)
        if cu_seqlens is None:
            token_log_ratio = seq_log_ratio.unsqueeze(-1).expand_as(log_ratio)
        else:
            token_log_ratio = seq_log_ratio[segment_ids(cu_seqlens, log_ratio.shape[0])]
    else:
        token_log_ratio = log_ratio
    ratio = torch.exp(token_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    if mode == "truncate":
        weights = ratio.clamp(max=cap)
        outside = ratio > cap
    else:
        lower_bound = 1.0 / cap if lower is None else lower
        outside = (ratio > cap) | (ratio < lower_bound)
        weights = torch.where(outside, torch.zeros_like(ratio), ratio)
    weights = (weights * weights_mask).detach()
    num_valid = weights_mask.sum().clamp(min=1.0)
    metrics = {
        "mismatch/abs_log_ratio_mean": log_ratio.abs().sum() / num_valid,
        "mismatch/frac_capped": (outside * weights_mask).sum() / num_valid,
        "mismatch/weight_mean": weights.sum() / num_valid,
    }
    if not tensor_metrics:
        metrics = {key: float(value) for key, value in metrics.items()}
    return weights, metrics


def off_policy_sequence_mask(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    delta: float,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Off-policy sequence masking, as slime's ``compute_opsm_mask``: a sequence's drift
    is the mean over its valid tokens of ``old_log_probs - log_probs`` (a KL estimate of
    the old policy against the current one); a token is dropped where its advantage is
    negative and its sequence's drift exceeds ``delta``.

    Shapes: ``[B, T]`` with ``mask``, or packed ``[N]`` with ``cu_seqlens`` ``[B + 1]``.
    Returns ``(keep, dropped)``, both detached float tensors of the input shape: ``keep``
    multiplies the per-token policy loss (1 = kept), ``dropped`` is 1 on dropped valid
    tokens (for the metric).
    """
    weights = mask.to(wide(log_probs).dtype)
    drift = (wide(old_log_probs) - wide(log_probs)).detach() * weights
    sums, counts = row_sums_and_counts(drift, weights, cu_seqlens)
    seq_drift = sums / counts.clamp(min=1.0)
    if cu_seqlens is None:
        token_drift = seq_drift.unsqueeze(-1).expand_as(drift)
    else:
        token_drift = seq_drift[segment_ids(cu_seqlens, drift.shape[0])]
    dropped = ((advantages < 0) & (token_drift > delta)).to(weights.dtype) * weights
    return 1.0 - dropped, dropped


def logprob_gap_share(
    trainer_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_tokens: float,
) -> torch.Tensor:
    """One micro-batch's part of the step's mean ``|trainer - engine|`` log-prob gap: the
    sum over its valid tokens divided by the step's valid tokens ``num_tokens``, so that
    summing a step's micro-batches gives the mean. Backends report it as
    ``mismatch/logprob_abs_diff_mean`` when their own forward supplies the trainer's side
    (an on-policy step without a separate old-log-prob pass)."""
    gap = (wide(trainer_log_probs.detach()) - wide(rollout_log_probs)).abs()
    return (gap * mask).sum() / max(float(num_tokens), 1.0)
