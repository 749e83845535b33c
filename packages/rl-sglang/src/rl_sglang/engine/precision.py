"""Whether float32 matmuls on CUDA run without TF32, said once in a line a person reads.

PyTorch's default float32 matmul precision is "highest": on an A100/H100 a float32 model
then runs its matmuls at full fp32 speed, several times slower than in bfloat16 or with
TF32. That is a choice worth making knowingly, so start-up says it (the embedded engine in
its log, rl-train on the console) instead of leaving a slow run unexplained.
"""

import torch

TF32_OFF = (
    "float32 matmuls on CUDA run with TF32 off (torch's default precision 'highest'): "
    "several times slower than bfloat16 weights or TF32 "
    "(torch.set_float32_matmul_precision('high'), which rounds matmul inputs to 10-bit "
    "mantissas)"
)


def tf32_hint(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """:data:`TF32_OFF` when matmuls of ``dtype`` on ``device`` are float32 on CUDA at the
    current precision 'highest'; None otherwise (CPU, bfloat16, or TF32 already on)."""
    if torch.device(device).type != "cuda" or dtype != torch.float32:
        return None
    if torch.get_float32_matmul_precision() != "highest":
        return None
    return TF32_OFF
