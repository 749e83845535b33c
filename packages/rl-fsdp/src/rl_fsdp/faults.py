"""Non-finite steps: one decision for all ranks, and the metrics that report it.

A step is *non-finite* when any rank sees NaN or inf in a loss metric (``loss/*``, summed
over ranks) or in the global gradient norm. Every rank then skips the update together:
parameters, AdamW state, the LR schedule and ``step`` stay as they were (as mixed-precision
loss scalers skip an overflowing step), and the poisoned gradients are dropped.
"""

import math

import torch

from rl_fsdp.distributed import all_reduce_max_int


def locally_nonfinite(metrics: dict[str, float], grad_norm: float) -> bool:
    """True when this rank's loss metrics or gradient norm hold NaN or inf."""
    losses = [value for key, value in metrics.items() if key.startswith("loss/")]
    return not all(math.isfinite(v) for v in [*losses, grad_norm])


def any_rank_nonfinite(metrics: dict[str, float], grad_norm: float, device: torch.device) -> bool:
    """:func:`locally_nonfinite` OR-ed over all ranks (one all-reduce), so no rank ever
    steps while another skips (which would desynchronise the replicas or hang a collective)."""
    return bool(all_reduce_max_int(int(locally_nonfinite(metrics, grad_norm)), device))


def step_metrics(*, skipped: bool, grad_norm: float) -> dict[str, float]:
    """``train/nonfinite_skipped`` (1.0 when the update was skipped) and the norm as seen."""
    return {"train/nonfinite_skipped": float(skipped), "train/grad_norm": grad_norm}
