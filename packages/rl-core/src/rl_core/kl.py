"""Per-token KL estimators between the policy and a reference (Schulman's k1/k2/k3).

Shapes: every tensor is elementwise and broadcastable, typically ``[B, T]`` or packed ``[N]``.
With ``d = log_probs - ref_log_probs`` (log pi - log pi_ref, sampled under pi):

- ``k1``: d (unbiased, high variance, can be negative)
- ``k2``: d**2 / 2
- ``k3``: exp(-d) - 1 + d (unbiased, non-negative, low variance)
- ``low_var_kl``: k3 clamped to [-10, 10] (stable against extreme ratios)
"""

import torch

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")

_LOW_VAR_KL_BOUND = 10.0


def approx_kl(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, *, kind: str = "k3"
) -> torch.Tensor:
    """Elementwise KL estimate of pi against pi_ref from sampled-token log-probs.

    Args:
        log_probs: log pi(token), any shape.
        ref_log_probs: log pi_ref(token), same shape.
        kind: one of ``KL_KINDS``.
    Returns:
        Tensor of the broadcast shape, float32 or wider.
    """
    d = log_probs.float() - ref_log_probs.float()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind in ("k3", "low_var_kl"):
        k3 = torch.expm1(-d) + d
        if kind == "low_var_kl":
            return k3.clamp(-_LOW_VAR_KL_BOUND, _LOW_VAR_KL_BOUND)
        return k3
    raise ValueError(f"unknown KL kind {kind!r}; choose one of: {', '.join(KL_KINDS)}")
