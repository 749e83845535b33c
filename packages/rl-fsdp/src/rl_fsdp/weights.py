"""Weights out of the sharded model: byte-bounded buckets of full HF-named tensors, and a
plain Hugging Face directory written from them.

Each parameter is all-gathered alone (``DTensor.full_tensor``; on one rank its local
shard is already whole), so a rank never holds more than the bucket being filled plus one
tensor. Tied weights appear once (under the
name ``named_parameters`` gives them, e.g. ``model.embed_tokens.weight``); the HF config's
``tie_word_embeddings`` restores the tie on load. Names are the checkpoint's: weights that
transformers fuses in memory (MoE experts) leave split as ``save_pretrained`` writes them.
"""

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rl_core.protocols import WeightBucket
from rl_core.weights import HF_TOKENIZER_FILES, bucket_by_bytes
from rl_fsdp.lora import merge_lora


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The unsharded value of a (possibly DTensor) parameter, detached. On a mesh of one
    rank the local shard is the whole tensor: returned as is (no gather, no copy)."""
    value = param.detach()
    if not hasattr(value, "full_tensor"):
        return value
    if value.device_mesh.size() == 1:
        return value.to_local()
    return value.full_tensor()


def iter_weight_buckets(
    model: nn.Module,
    *,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    lora_scaling: float | None = None,
    copies: dict[int, torch.Tensor] | None = None,
) -> Iterator[WeightBucket]:
    """Buckets ``[(hf_name, full tensor)]`` of at most ``bucket_bytes`` each (a larger
    tensor travels alone). With ``lora_scaling`` the model's LoRA adapters are merged into
    their weights (:func:`rl_fsdp.lora.merge_lora`, before the cast to ``dtype``).
    ``copies``: by ``id(parameter)``, a tensor holding that parameter's current values
    already in ``dtype`` (a single rank's compute copy), sent instead of casting again.
    Collective: every rank must iterate to the end."""

    names = checkpoint_namer(model)
    copies = copies or {}
    named = (
        (name, copies[id(param)] if id(param) in copies else full_tensor(param))
        for name, param in model.named_parameters()
    )
    if lora_scaling is not None:
        named = merge_lora(named, scaling=lora_scaling)

    def full_tensors():
        for name, tensor in named:
            yield from names(name, tensor if dtype is None else tensor.to(dtype))

    yield from bucket_by_bytes(full_tensors(), bucket_bytes=bucket_bytes)


def checkpoint_namer(model: nn.Module):
    """``names(name, tensor) -> [(hf_name, tensor), ...]``: a parameter under the names an
    HF checkpoint (and SGLang's loader) uses. transformers 5 fuses some weights in memory
    (Qwen3-MoE's experts: ``mlp.experts.gate_up_proj`` ``[E, 2I, h]`` for the per-expert
    ``mlp.experts.{e}.gate_proj.weight`` / ``up_proj``); its own reverse conversion, the
    one ``save_pretrained`` applies, splits them back (views, no copy)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import revert_weight_conversion

    if not getattr(model, "_weight_conversions", None) and not get_model_conversion_mapping(
        model, add_legacy=False
    ):
        return lambda name, tensor: [(name, tensor)]
    return lambda name, tensor: list(revert_weight_conversion(model, {name: tensor}).items())


def write_hf_dir(
    path: Path,
    buckets: Iterator[WeightBucket],
    hf_config,
    *,
    source_dir: str | None = None,
) -> None:
    """Write a loadable HF directory: one safetensors shard per bucket, its index,
    config.json and the tokenizer files of ``source_dir``. Rank 0 writes to ``<path>.tmp``
    and renames it; the other ranks only drain the (collective) iterator."""
    from safetensors.torch import save_file

    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    for index, bucket in enumerate(buckets):
        if rank != 0:
            continue
        shard = f"model-{index + 1:05d}.safetensors"
        tensors = {name: t.contiguous().cpu() for name, t in bucket}
        save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
    if rank == 0:
        _write_metadata(tmp, weight_map, hf_config, source_dir)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()


def _write_metadata(tmp: Path, weight_map: dict[str, str], hf_config, source_dir) -> None:
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_config.save_pretrained(tmp)
    for name in HF_TOKENIZER_FILES if source_dir else ():
        if (Path(source_dir) / name).is_file():
            shutil.copy2(Path(source_dir) / name, tmp / name)
