"""Per-token KL estimators between the policy and a reference (Schulman's k1/k2/k3).

Shapes: every tensor is elementwise and broadcastable, typically ``[B, T]`` or packed ``[N]``.
With ``d = log_probs - ref_log_probs`` (log pi - log pi_ref, sampled under pi):

- ``k1``: d (unbiased, high variance, can be negative)
- ``k2``: d**2 / 2
- ``k3``: exp(-d) - 1 + d (unbiased, non-negative, low variance)
- ``low_var_kl``: k3 clamped to [-10, 10] (stable against extreme ratios)

For k3 and low_var_kl, d is first clamped to [-20, 20] (as verl does): a masked token
with an absurd log-ratio (d < -88 overflows float32's exp) would otherwise give an
infinite value, and through the clamp a NaN gradient (0 · inf) that poisons every weight.
Inside that range, where every real token lies, the values are the formulas above.

:func:`importance_weighted_kl` is the unbiased estimate when the tokens were sampled from
an older policy pi_old rather than pi: the estimator above times pi / pi_old (DeepSeek-V3.2's
unbiased KL; slime's ``--use-unbiased-kl``).
"""

import torch

from rl_core._dtype import wide
from rl_core.names import KL_KINDS

_LOW_VAR_KL_BOUND = 10.0
_MAX_LOG_RATIO = 20.0


def approx_kl(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, *, kind: str = "k3"
) -> torch.Tensor:
    """Elementwise KL estimate of pi against pi_ref from sampled-token log-probs.

    Args:
        log_probs: log pi(token), any shape.
        ref_log_probs: log pi_ref(token), same shape.
        kind: one of ``KL_KINDS``.
    Returns:
        Tensor of the broadcast shape, float32 (float64 for float64 inputs).
    """
    d = wide(log_probs) - wide(ref_log_probs)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind in ("k3", "low_var_kl"):
        d = d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        k3 = torch.expm1(-d) + d
        if kind == "low_var_kl":
            return k3.clamp(-_LOW_VAR_KL_BOUND, _LOW_VAR_KL_BOUND)
        return k3
    raise ValueError(f"unknown KL kind {kind!r}; choose one of: {', '.join(KL_KINDS)}")


def importance_weighted_kl(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    *,
    kind: str = "k3",
) -> torch.Tensor:
    """Elementwise KL estimate of pi against pi_ref from tokens sampled under pi_old.

    ``exp(log_probs - old_log_probs) * approx_kl(log_probs, ref_log_probs, kind)``; the
    ratio keeps its gradient (as slime's ``compute_approx_kl`` with ``importance_ratio``),
    and for ``low_var_kl`` the [-10, 10] clamp applies to the product, not the estimate.
    Shapes as :func:`approx_kl` (``old_log_probs`` the same shape); float32 or float64.
    """
    log_ratio = (wide(log_probs) - wide(old_log_probs)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    unclamped_kind = "k3" if kind == "low_var_kl" else kind
    weighted = torch.exp(log_ratio) * approx_kl(log_probs, ref_log_probs, kind=unclamped_kind)
    if kind == "low_var_kl":
        return weighted.clamp(-_LOW_VAR_KL_BOUND, _LOW_VAR_KL_BOUND)
    return weighted
