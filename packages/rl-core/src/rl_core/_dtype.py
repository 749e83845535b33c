"""The floating-point type rl-core's maths runs in.

Half-precision inputs are promoted to float32 (losses and statistics in bf16 lose too
much); float64 inputs stay float64, so a float64 check (``torch.autograd.gradcheck``,
a reference comparison) sees float64 results instead of silently rounded ones.
"""

import torch


def wide(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as float32, or unchanged when it already is float64."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()
