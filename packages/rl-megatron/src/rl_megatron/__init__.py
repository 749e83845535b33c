"""rl-megatron: the megatron-core training backend (TP, SP, PP, CP, DP, EP) for RL.

Layers: :mod:`config` (validated settings), :mod:`backend` (``MegatronBackend``, the
rl_core TrainingBackend) and :mod:`state` (its export, checkpoints, offload);
:mod:`models`, :mod:`layers`, :mod:`attention`, :mod:`moe` (GPTModel from an HF config); :mod:`layout`, :mod:`weights`, :mod:`export` (HF <-> Megatron);
:mod:`forward`, :mod:`vocab_parallel`, :mod:`objective`, :mod:`cp` (per-token maths);
:mod:`parallel`, :mod:`pipeline` (1F1B / GPipe), :mod:`optim`, :mod:`precision` (bf16 with
fp32 main grads and masters), :mod:`fusions` (megatron's compiled SwiGLU),
:mod:`checkpoint` and :mod:`dist_ckpt` (atomic megatron distributed checkpoints);
:mod:`shape` (the HF config read and the family check), :mod:`convert` and :mod:`cli`
(``rl-convert``); :mod:`testing.cpu_shim` (megatron on CPU for tests and conversions).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rl-megatron")
except PackageNotFoundError:
    __version__ = "0.0.0"
