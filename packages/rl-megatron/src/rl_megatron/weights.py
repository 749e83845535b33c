"""HF -> Megatron: load HF weights straight into this rank's shards.

Each rank reads only the rows/columns its shard needs (safetensors slices), so no rank
builds the full model. Sources are an HF safetensors directory (:class:`SafetensorsReader`)
or an in-memory HF state dict (:class:`StateDictReader`); both expose
``read(name, dim0, dim1)`` returning a slice.
"""

from pathlib import Path

import torch

from rl_core.freezing import compile_patterns, is_trained
from rl_megatron.layout import is_hf_buffer, param_layout, qkv_rows, shard_range
from rl_megatron.models import ValueHead
from rl_megatron.parallel import ParallelLayout
from rl_megatron.shape import ModelShape


class StateDictReader:
    """Slices of an HF state dict held in memory (``{hf_name: tensor}``)."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.state_dict = state_dict

    def __contains__(self, name: str) -> bool:
        return name in self.state_dict

    def read(self, name: str, dim0: slice = slice(None), dim1: slice | None = None):
        tensor = self.state_dict[name][dim0]
        return tensor if dim1 is None else tensor[:, dim1]


class SafetensorsReader:
    """Slices read lazily from the ``*.safetensors`` files of an HF model directory."""

    def __init__(self, directory: str | Path):
        from safetensors import safe_open

        directory = Path(directory)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ValueError(
                f"no *.safetensors files in {directory}; save the model with safetensors"
            )
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}  # noqa: SIM118

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str, dim0: slice = slice(None), dim1: slice | None = None):
        view = self._where[name].get_slice(name)
        return view[dim0] if dim1 is None else view[dim0, dim1]


def hf_config_of(directory: str | Path):
    """The transformers config saved in an HF directory."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(directory))


def load_hf_weights(model, reader, shape: ModelShape, parallel: ParallelLayout) -> None:
    """Copy every parameter of ``model`` (this rank's GPTModel shard) from ``reader``
    (a critic's value head, ``output_layer``, is left as it is), and the buffers HF saves
    (DeepSeek-V3's expert bias)."""
    shards = read_shards(model, reader, shape, parallel)
    params = dict(model.named_parameters())
    offset = layer_offset(model)
    with torch.no_grad():
        for name, shard in shards.items():
            params[name].copy_(shard)
        for name, buffer in hf_buffers(model):
            hf_name = param_layout(name, layer_offset=offset, shape=shape).hf_names[0]
            buffer.copy_(reader.read(hf_name))


def hf_buffers(model) -> list[tuple[str, torch.Tensor]]:
    """``(megatron name, buffer)`` of the buffers that hold HF checkpoint tensors."""
    return [(name, b) for name, b in model.named_buffers() if is_hf_buffer(name)]


def read_shards(model, reader, shape: ModelShape, parallel: ParallelLayout):
    """``{megatron_name: this rank's shard}`` for every parameter of ``model``, from HF."""
    offset = layer_offset(model)
    expert_offset = parallel.ep_rank * shape.num_experts // parallel.ep_size
    shards = {}
    for name, param in model.named_parameters():
        if _is_value_head(model, name):
            continue
        layout = param_layout(name, layer_offset=offset, expert_offset=expert_offset, shape=shape)
        tp_size, tp_rank = (
            (parallel.etp_size, parallel.etp_rank)
            if layout.expert
            else (parallel.tp_size, parallel.tp_rank)
        )
        shard = _read_shard(reader, layout, shape, param.shape, tp_size, tp_rank)
        if shard.shape != param.shape:
            raise ValueError(
                f"{name}: HF gives {tuple(shard.shape)}, model has {tuple(param.shape)}"
            )
        shards[name] = shard
    return shards


def _is_value_head(model, name: str) -> bool:
    return name.startswith("output_layer.") and isinstance(model.output_layer, ValueHead)


def layer_offset(model) -> int:
    """Global HF layer number minus the index in this stage's parameter names (megatron
    numbers layers globally in ``layer_number``; name indices depend on its version)."""
    layers = model.decoder.layers
    if not len(layers):
        return 0
    first_name = next(iter(layers._modules))
    return layers[0].layer_number - 1 - int(first_name)


def _read_shard(reader, layout, shape: ModelShape, param_shape, tp_size: int, tp_rank: int):
    names = layout.hf_names
    if layout.kind == "vocab":
        source = names[0] if names[0] in reader else "model.embed_tokens.weight"  # tied in HF
        return _vocab_shard(reader, source, shape, tp_size, tp_rank)
    if layout.kind == "replicated":
        return reader.read(names[0])
    if layout.kind == "column":
        return reader.read(names[0], shard_range(param_shape[0] * tp_size, tp_size, tp_rank))
    if layout.kind == "row":
        return reader.read(
            names[0], slice(None), shard_range(param_shape[1] * tp_size, tp_size, tp_rank)
        )
    if layout.kind == "gate_up":
        rows = shard_range(param_shape[0] // 2 * tp_size, tp_size, tp_rank)
        return torch.cat([reader.read(names[0], rows), reader.read(names[1], rows)])
    if layout.kind == "fused_gate_up":  # one HF tensor [gate; up]
        half = param_shape[0] // 2 * tp_size
        rows = shard_range(half, tp_size, tp_rank)
        up_rows = slice(half + rows.start, half + rows.stop)
        return torch.cat([reader.read(names[0], rows), reader.read(names[0], up_rows)])
    assert layout.kind == "qkv", layout.kind
    return _qkv_shard(reader, names, shape, tp_size, tp_rank)


def _vocab_shard(reader, name: str, shape: ModelShape, tp_size: int, tp_rank: int):
    rows = shard_range(shape.padded_vocab_size, tp_size, tp_rank)
    real = reader.read(name, slice(rows.start, min(rows.stop, shape.vocab_size)))
    padding = real.new_zeros(rows.stop - rows.start - real.shape[0], *real.shape[1:])
    return torch.cat([real, padding])


def _qkv_shard(reader, names, shape: ModelShape, tp_size: int, tp_rank: int):
    groups = shard_range(shape.num_kv_heads, tp_size, tp_rank)
    pieces = []
    for group in range(groups.start, groups.stop):
        q_rows, kv_rows = qkv_rows(shape, group)
        pieces += [reader.read(names[0], q_rows), reader.read(names[1], kv_rows)]
        pieces.append(reader.read(names[2], kv_rows))
    return torch.cat(pieces)


def hf_sources(model, shape: ModelShape, parallel: ParallelLayout) -> dict[str, tuple[str, ...]]:
    """``{megatron_name: the HF names it is made of}`` for this rank's parameters (a
    critic's value head has none)."""
    offset = layer_offset(model)
    expert_offset = parallel.ep_rank * shape.num_experts // parallel.ep_size
    return {
        name: param_layout(
            name, layer_offset=offset, expert_offset=expert_offset, shape=shape
        ).hf_names
        for name, _ in model.named_parameters()
        if not _is_value_head(model, name)
    }


def freeze_by_hf_name(model, shape: ModelShape, parallel, train_only=(), freeze=()) -> None:
    """Turn off ``requires_grad`` of the parameters whose HF sources the patterns do not
    train (rl_core.freezing). Patterns are checked against this rank's HF names (a
    pipeline stage sees only its layers: the launcher checks the whole model first)."""
    if not train_only and not freeze:
        return
    sources = hf_sources(model, shape, parallel)
    names = [hf for hf_names in sources.values() for hf in hf_names]
    compile_patterns(train_only, field="MegatronConfig.train_only")
    compile_patterns(freeze, field="MegatronConfig.freeze")
    params = dict(model.named_parameters())
    for name, hf_names in sources.items():
        trained = {is_trained(hf, train_only, freeze) for hf in hf_names}
        if len(trained) > 1:
            raise ValueError(
                f"megatron parameter {name} fuses {list(hf_names)}, which the train_only / "
                "freeze patterns split; Megatron trains or freezes them together: match all "
                "of them or none"
            )
        if trained == {False}:
            params[name].requires_grad_(False)
    if not any(p.requires_grad for p in params.values()) and names:
        raise ValueError(
            "train_only / freeze leave no parameter of this rank to train (with pp > 1: of "
            "this pipeline stage); every stage needs a trained parameter"
        )
