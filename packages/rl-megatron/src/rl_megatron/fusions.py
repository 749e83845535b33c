"""Megatron's fused SwiGLU, checked once per process before a model uses it.

megatron-core 0.16 fuses the MLP activation (``bias_activation_fusion``) with
``torch.compile`` (its ``jit_fuser`` on torch >= 2.2): SiLU(gate) · up is one generated
kernel forward and one backward, and only the ``[s, b, 2·ffn]`` input is kept for
backward, where the eager activation runs four elementwise passes each way. No Transformer
Engine or Apex is needed. torch.compile needs Triton on GPU and a C++ compiler on CPU, so
:func:`fused_swiglu_works` runs it once on a small tensor and reports failure instead of
letting the first training step raise. The probe has the model's activation width, so
that the kernels compiled afterwards for real batches stay specialised to it (only the
token count becomes dynamic: no runtime division by a symbolic width in the kernel).
"""

import functools
import warnings

import torch


@functools.cache
def fused_swiglu_works(device: torch.device, dtype: torch.dtype, width: int) -> bool:
    """True when megatron's fused SwiGLU compiles and runs forward and backward on
    ``device`` in ``dtype`` for inputs ``[s, b, width]`` (``width`` = 2 · ffn / tp);
    False (with a warning naming the error) otherwise."""
    try:
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

        probe = torch.ones(2, 1, width, device=device, dtype=dtype, requires_grad=True)
        bias_swiglu_impl(probe, None).sum().backward()
        return probe.grad is not None and bool(torch.isfinite(probe.grad).all())
    except Exception as error:  # any compile failure means: run unfused
        warnings.warn(
            f"fused SwiGLU (torch.compile) failed on {device} ({type(error).__name__}: "
            f"{error}); using the unfused activation. Install triton (GPU) or a C++ "
            "compiler (CPU), or set swiglu_fusion=False to silence this.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
