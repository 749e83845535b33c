"""Megatron -> HF: full HF-named tensors from this rank's shards, in bounded buckets, and
a complete HF safetensors directory written atomically.

Every TP rank gathers each parameter's shards and yields the same full tensors (all ranks
call together). Shapes: a gathered shard list is ``tp_size`` tensors of the shard shape.
"""

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from rl_core.weights import bucket_by_bytes
from rl_megatron.checkpoint import swap_into_place
from rl_megatron.layout import param_layout, qkv_rows
from rl_megatron.precision import grad_of
from rl_megatron.shape import ModelShape
from rl_megatron.weights import hf_buffers, layer_offset


def hf_tensors(
    model, shape: ModelShape, *, grads: bool = False, on_device: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every HF weight (detached copies, on CPU, or on the
    model's device with ``on_device``: a weight sync to colocated engines then never
    crosses PCIe twice); ``grads=True`` gives the gradients in the same layout. With
    pipeline stages, each stage's tensors are broadcast to the others in stage order, so
    every rank yields the whole model."""
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        yield from stage_tensors(model, shape, grads=grads, on_device=on_device)
        return
    pp_group = ps.get_pipeline_model_parallel_group()
    if _world(pp_group) == 1:
        yield from stage_tensors(model, shape, grads=grads, on_device=on_device)
        return
    device = next((model[0] if isinstance(model, list) else model).parameters()).device
    for src in dist.get_process_group_ranks(pp_group):
        source = src == dist.get_rank()
        mine = list(stage_tensors(model, shape, grads=grads, on_device=on_device)) if source else []
        meta = [[(name, tensor.shape, tensor.dtype) for name, tensor in mine]]
        dist.broadcast_object_list(meta, src=src, group=pp_group)
        for index, (name, shape_, dtype) in enumerate(meta[0]):
            tensor = (
                mine[index][1].to(device)
                if mine
                else torch.empty(shape_, dtype=dtype, device=device)
            )
            dist.broadcast(tensor, src=src, group=pp_group)
            yield name, tensor if on_device else tensor.cpu()


def stage_tensors(
    model, shape: ModelShape, *, grads: bool = False, on_device: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every HF weight, in model order (detached copies, on
    CPU unless ``on_device``);
    ``grads=True`` gives the parameters' gradients (fp32 main grads under bf16) in the same
    HF layout instead. ``model`` may be a stage's list of model chunks (virtual pipeline).
    Dense weights are gathered over TP; expert weights over expert-TP, then over EP."""
    if isinstance(model, list):
        for chunk in model:
            yield from stage_tensors(chunk, shape, grads=grads, on_device=on_device)
        return
    tp_group, etp_group, ep_group = _groups()
    offset = layer_offset(model)
    local_experts = shape.num_experts // _world(ep_group) if shape.num_experts else 0
    seen = set()
    tensors = list(model.named_parameters()) + ([] if grads else hf_buffers(model))
    for name, param in tensors:
        if name == "output_layer.weight" and shape.tie_embeddings:
            continue  # a later pipeline stage's copy of the tied embedding
        tensor = grad_of(param) if grads else param
        tensor = (torch.zeros_like(param) if tensor is None else tensor).detach()
        layout = param_layout(name, layer_offset=offset, shape=shape)
        if not layout.expert:
            pairs = _unfuse(layout, _gather(tensor, tp_group), shape)
        else:
            pairs = []
            full = [t for _, t in _unfuse(layout, _gather(tensor, etp_group), shape)]
            per_rank = zip(*[_gather(t, ep_group) for t in full], strict=True)
            for ep_rank, tensors in enumerate(per_rank):
                names = param_layout(
                    name, layer_offset=offset, expert_offset=ep_rank * local_experts, shape=shape
                )
                pairs += zip(names.hf_names, tensors, strict=True)
        for hf_name, full_tensor in pairs:
            if hf_name not in seen:  # TE-fused norms map twice; tied heads once
                seen.add(hf_name)
                # a copy, never a view of a parameter
                yield (
                    hf_name,
                    full_tensor.clone() if on_device else full_tensor.to("cpu", copy=True),
                )


def _groups():
    """(TP, expert-TP, EP) process groups, or Nones outside a distributed run."""
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        return None, None, None
    return (
        ps.get_tensor_model_parallel_group(),
        ps.get_expert_tensor_parallel_group(),
        ps.get_expert_model_parallel_group(),
    )


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def hf_buckets(model, shape: ModelShape, *, bucket_bytes: int, on_device: bool = False):
    """:func:`hf_tensors` grouped into lists of at most ``bucket_bytes`` (a larger tensor
    travels alone)."""
    tensors = hf_tensors(model, shape, on_device=on_device)
    return bucket_by_bytes(tensors, bucket_bytes=bucket_bytes)


def _gather(shard: torch.Tensor, group) -> list[torch.Tensor]:
    world = _world(group)
    if world == 1:
        return [shard]
    shards = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(shards, shard.contiguous(), group=group)
    return shards


def _unfuse(layout, shards: list[torch.Tensor], shape: ModelShape):
    names = layout.hf_names
    if layout.kind == "replicated":
        return [(names[0], shards[0])]
    if layout.kind == "vocab":
        return [(names[0], torch.cat(shards)[: shape.vocab_size])]
    if layout.kind == "column":
        return [(names[0], torch.cat(shards))]
    if layout.kind == "row":
        return [(names[0], torch.cat(shards, dim=1))]
    if layout.kind in ("gate_up", "fused_gate_up"):
        halves = [s.chunk(2) for s in shards]
        gate, up = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
        if layout.kind == "fused_gate_up":
            return [(names[0], torch.cat([gate, up]))]
        return [(names[0], gate), (names[1], up)]
    assert layout.kind == "qkv", layout.kind
    return _split_qkv(names, torch.cat(shards), shape)


def _split_qkv(names, fused: torch.Tensor, shape: ModelShape):
    """Fused ``[groups · (q_per_group + 2) · head_dim, ...]`` -> HF q, k, v."""
    q_per_group = qkv_rows(shape, 0)[0].stop
    per_group = fused.view(shape.num_kv_heads, q_per_group + 2 * shape.head_dim, *fused.shape[1:])
    q, k, v = per_group.split([q_per_group, shape.head_dim, shape.head_dim], dim=1)
    return [(n, t.reshape(-1, *fused.shape[1:])) for n, t in zip(names, (q, k, v), strict=True)]


def save_hf_directory(
    model,
    shape: ModelShape,
    hf_config,
    directory: str | Path,
    *,
    shard_bytes: int = 4 << 30,
    dtype: torch.dtype | None = None,
    extra: Callable[[Path], None] | None = None,
) -> None:
    """Write config + safetensors shards of the full model to ``directory`` atomically
    (a temporary sibling renamed into place). All ranks call; global rank 0 writes, with
    ``extra(tmp)`` adding its own files (tokenizer) before the rename."""
    directory = Path(directory)
    writer = not dist.is_initialized() or dist.get_rank() == 0
    if writer:
        directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = (
        Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        if writer
        else None
    )
    weight_map = {}
    buckets = hf_buckets(model, shape, bucket_bytes=shard_bytes)
    for index, bucket in enumerate(buckets):
        if writer:
            weight_map.update(_write_shard(tmp, index, bucket, dtype))
    if writer:
        if extra is not None:
            extra(tmp)
        _finish_directory(tmp, directory, hf_config, weight_map)
    if dist.is_initialized():
        dist.barrier()


def _write_shard(tmp: Path, index: int, bucket, dtype) -> dict[str, str]:
    from safetensors.torch import save_file

    file_name = f"model-{index:05d}.safetensors"
    tensors = {n: (t if dtype is None else t.to(dtype)).contiguous() for n, t in bucket}
    save_file(tensors, str(tmp / file_name), metadata={"format": "pt"})
    return dict.fromkeys(tensors, file_name)


def _finish_directory(tmp: Path, directory: Path, hf_config, weight_map: dict[str, str]) -> None:
    import json

    hf_config.save_pretrained(str(tmp))
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    swap_into_place(tmp, directory)
