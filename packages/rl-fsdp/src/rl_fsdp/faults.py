"""Non-finite steps: one decision for all ranks, made on the device, and its metrics.

A step is *non-finite* when any rank sees NaN or inf in a loss metric (``loss/*``) or in
the global gradient norm. Every rank then skips the update together: parameters, AdamW
state, the LR schedule and ``step`` stay as they were (as mixed-precision loss scalers
skip an overflowing step), and the poisoned gradients are dropped.

The decision is a 0-d float32 flag on the device (:func:`nonfinite_flag`), handed to the
fused AdamW, which skips its update when the flag is set (:func:`guarded_step`, the
mechanism of ``torch.amp.GradScaler``). So the optimizer step is queued before anything is
read back, and the step's one read of its metrics also reads the flag.
"""

import torch
import torch.distributed as dist


def nonfinite_flag(sums: dict, grad_norm: torch.Tensor, device: torch.device) -> torch.Tensor:
    """1.0 when this or any other rank's ``loss/*`` metrics or ``grad_norm`` hold NaN or
    inf, else 0.0: a float32 tensor on ``device``, maxed over ranks, never read back."""
    losses = [value for key, value in sums.items() if key.startswith("loss/")]
    values = [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(1) for v in losses]
    values.append(grad_norm.detach().to(device, torch.float64).reshape(1))
    flag = (~torch.isfinite(torch.cat(values)).all()).to(torch.float32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def guarded_step(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """``optimizer.step()`` skipped on the device when ``flag`` is 1 (a fused Adam/AdamW:
    its kernel leaves parameters and moments alone and takes its step counts back)."""
    if not optimizer.defaults.get("fused"):
        raise ValueError("guarded_step needs a fused optimizer (fused=True)")
    optimizer.found_inf = flag
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def step_metrics(*, skipped: bool, grad_norm: float) -> dict[str, float]:
    """``train/nonfinite_skipped`` (1.0 when the update was skipped) and the norm as seen."""
    return {"train/nonfinite_skipped": float(skipped), "train/grad_norm": grad_norm}
