"""Block-wise FP8 weights for rollout engines: the layout of DeepSeek-V3's checkpoints and of
SGLang's ``quantization: fp8`` with ``weight_block_size``.

A 2-D weight ``W`` ``[N, K]`` becomes ``float8_e4m3fn`` values ``Q`` ``[N, K]`` and one
float32 ``weight_scale_inv`` ``S`` ``[ceil(N / bn), ceil(K / bk)]`` per ``bn x bk`` block
(128 x 128): ``S[i, j] = max |W|`` over block (i, j), divided by 448 (the largest e4m3
value), and ``W ~= Q * S`` (the scale a dequantiser multiplies by, despite its name). Edge
blocks of a dimension not divisible by the block are smaller; nothing is padded in the
output. An all-zero block gets a tiny scale instead of zero (no 0/0).

Which weights: the 2-D ``.weight`` of the linear layers inside decoder layers (attention
and MLP projections, MoE experts); embeddings, norms, ``lm_head``, biases and router gates
stay in the trainer's dtype, as slime's converter and SGLang's ignored layers have them.
"""

import math
import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
BLOCK_SIZE = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # "<module>.weight" -> "<module>.weight_scale_inv"
MIN_BLOCK_MAX = 1e-12  # an all-zero block's max, so that its scale is not 0

_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")
# a module kept in the trainer's dtype when its last name part is one of these, or contains
# "norm": routers (MoE ``mlp.gate``, Qwen2-MoE's ``shared_expert_gate``) and 1-row heads
_KEPT_MODULES = {"gate", "router", "shared_expert_gate", "embed_tokens", "lm_head"}


def quantize_block_fp8(
    weight_NK: torch.Tensor, block_size: tuple[int, int] = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q [N, K] float8_e4m3fn, S [ceil(N/bn), ceil(K/bk)] float32)`` with
    ``weight ~= Q * S`` block by block. Computed in float32 on the weight's device."""
    assert weight_NK.dim() == 2, f"a 2-D weight, got shape {tuple(weight_NK.shape)}"
    (n, k), (bn, bk) = weight_NK.shape, block_size
    tiles_n, tiles_k = math.ceil(n / bn), math.ceil(k / bk)
    padded = F.pad(weight_NK.float(), (0, tiles_k * bk - k, 0, tiles_n * bn - n))
    blocks = padded.view(tiles_n, bn, tiles_k, bk)
    block_max = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=MIN_BLOCK_MAX)
    scale = block_max / FP8_MAX  # [tiles_n, 1, tiles_k, 1]
    quantized = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    quantized = quantized.view(tiles_n * bn, tiles_k * bk)[:n, :k].contiguous()
    return quantized, scale.view(tiles_n, tiles_k)


def dequantize_block_fp8(
    quantized_NK: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    block_size: tuple[int, int] = BLOCK_SIZE,
) -> torch.Tensor:
    """``Q * S`` block by block, in ``dtype``: the weight an FP8 engine computes with."""
    (n, k), (bn, bk) = quantized_NK.shape, block_size
    expected = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not fit a [{n}, {k}] "
            f"weight in {bn}x{bk} blocks (expected {expected})"
        )
    scale_NK = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (quantized_NK.float() * scale_NK).to(dtype)


def is_quantized_weight(name: str, shape: Iterable[int]) -> bool:
    """Whether the HF weight ``name`` of ``shape`` travels as FP8 (see the module's text)."""
    if not name.endswith(".weight") or len(tuple(shape)) != 2:
        return False
    if _DECODER_LAYER.search(name) is None:
        return False
    leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
    return leaf not in _KEPT_MODULES and "norm" not in leaf


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def quantize_named(
    named: Iterable[tuple[str, torch.Tensor]], block_size: tuple[int, int] = BLOCK_SIZE
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a weight bucket as an FP8 engine loads them: each quantised weight
    followed by its ``weight_scale_inv``, the others as they are."""
    for name, tensor in named:
        if is_quantized_weight(name, tensor.shape):
            quantized, scale = quantize_block_fp8(tensor, block_size)
            yield name, quantized
            yield scale_name(name), scale
        else:
            yield name, tensor


def dequantize_named(
    named: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    block_size: tuple[int, int] = BLOCK_SIZE,
) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`quantize_named` for an engine that computes in ``dtype``: every
    FP8 weight times its ``weight_scale_inv`` (which must come with it), scales dropped,
    other tensors unchanged. ValueError naming a weight whose scale is missing."""
    named = list(named)
    scales = {n.removesuffix(SCALE_SUFFIX): t for n, t in named if n.endswith(SCALE_SUFFIX)}
    out = []
    for name, tensor in named:
        if name.endswith(SCALE_SUFFIX):
            continue
        if tensor.dtype == FP8_DTYPE:
            if name not in scales:
                raise ValueError(
                    f"FP8 weight {name!r} came without {scale_name(name)!r}; send each "
                    "quantised weight and its scale in the same bucket"
                )
            tensor = dequantize_block_fp8(tensor, scales[name], dtype, block_size)
        out.append((name, tensor))
    return out


def quantization_config(
    not_converted: Iterable[str] = (), block_size: tuple[int, int] = BLOCK_SIZE
) -> dict:
    """The ``quantization_config`` of an FP8 checkpoint's config.json (DeepSeek-V3's, the
    one SGLang's fp8 loader reads), ``not_converted``: the modules kept unquantised."""
    config = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block_size),
    }
    if kept := sorted(set(not_converted)):
        config["modules_to_not_convert"] = kept
    return config
