"""The learning-rate schedule both backends step by: linear warm-up, then constant, linear
or cosine decay to ``min_lr_ratio · lr`` at ``total_steps``.

    lr(step) = lr · lr_multiplier(step, warmup_steps=10, decay="cosine", total_steps=100)
"""

import math

LR_DECAYS = ("constant", "linear", "cosine")


def check_schedule(
    *, lr_decay: str, warmup_steps: int, total_steps: int | None, min_lr_ratio: float
) -> None:
    """ValueError naming the field when the schedule cannot run (the names both backends'
    configs give these fields)."""
    if lr_decay not in LR_DECAYS:
        raise ValueError(f"lr_decay must be one of {', '.join(LR_DECAYS)}, got {lr_decay!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if lr_decay != "constant" and not total_steps:
        raise ValueError(f"lr_decay={lr_decay!r} needs total_steps (the schedule length)")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")


def lr_multiplier(
    step: int,
    *,
    warmup_steps: int = 0,
    decay: str = "constant",
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> float:
    """Factor on the peak lr for optimizer step ``step`` (0-based, the step it is used
    for): ``(step + 1) / warmup_steps`` while warming up, then ``decay`` from 1 to
    ``min_lr_ratio`` over ``total_steps - warmup_steps`` steps (held there after)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    if decay not in LR_DECAYS:
        raise ValueError(f"decay must be one of {', '.join(LR_DECAYS)}, got {decay!r}")
    if not total_steps:
        raise ValueError(f"decay={decay!r} needs total_steps (the schedule length)")
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    # from 1 at the end of warm-up to 0 at total_steps
    falling = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * falling
