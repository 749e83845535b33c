"""Non-finite steps: one decision for all ranks.

A step is *non-finite* when NaN or inf shows in a loss metric (``loss/*``, already summed
over data-parallel ranks) or in the global gradient norm on any rank. Every rank then skips
the update together (a ZeRO-1 optimizer would otherwise wait in its broadcast for ranks
that skipped): parameters, fp32 masters, AdamW state and ``step`` stay as they were, and
the gradients are zeroed.
"""

import math

import torch
import torch.distributed as dist


def locally_nonfinite(metrics: dict[str, float], grad_norm: float) -> bool:
    """True when this rank's loss metrics or gradient norm hold NaN or inf."""
    losses = [value for key, value in metrics.items() if key.startswith("loss/")]
    return not all(math.isfinite(v) for v in [*losses, grad_norm])


def any_rank_nonfinite(metrics: dict[str, float], grad_norm: float, device) -> bool:
    """:func:`locally_nonfinite` OR-ed over the whole world (one all-reduce)."""
    local = locally_nonfinite(metrics, grad_norm)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    flag = torch.tensor([int(local)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
