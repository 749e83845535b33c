"""Hugging Face models: load or build (seeded random init), then shard with FSDP2.

Sharding is ``fully_shard`` on every decoder layer and once on the root (embeddings,
final norm, head), over one data-parallel mesh of all ranks. Tested families (from their
configs): Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Gemma, Gemma2, Gemma3 text; any HF
decoder whose layers are listed in ``_no_split_modules`` works.
"""

from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from rl_core.freezing import check_patterns, is_trained
from rl_fsdp.attention import register_packed_attention
from rl_fsdp.config import FSDPConfig
from rl_fsdp.fusion import compile_blocks, decoder_layers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def hf_config(config: FSDPConfig, **overrides):
    """The transformers config of ``config``'s model (from its directory or its fields)."""
    from transformers import AutoConfig

    if config.model_path is not None:
        path = Path(config.model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path={str(path)!r} has no config.json; give a local HF dir")
        return AutoConfig.from_pretrained(path, **overrides)
    fields = dict(config.model_config)
    return AutoConfig.for_model(fields.pop("model_type"), **fields, **overrides)


def build_model(config: FSDPConfig, *, head: str = "causal_lm") -> nn.Module:
    """Unsharded fp32 model on CPU with packed attention: ``head`` is "causal_lm" or
    "value" (token classification with one label: the critic's value head)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    attn = register_packed_attention()
    auto = AutoModelForCausalLM if head == "causal_lm" else AutoModelForTokenClassification
    # The value head must be deterministic: no classifier dropout.
    overrides = {"num_labels": 1, "classifier_dropout": 0.0} if head == "value" else {}
    cfg = hf_config(config, **overrides)
    torch.manual_seed(config.seed)
    if config.model_path is None:
        model = auto.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    else:
        model = auto.from_pretrained(
            config.model_path, config=cfg, attn_implementation=attn, dtype=torch.float32
        )
    model.config.use_cache = False
    return model


def shard_model(model: nn.Module, config: FSDPConfig, device: torch.device) -> nn.Module:
    """Apply FSDP2 per decoder layer and on the root; parameters end on ``device``
    (or on CPU with ``cpu_offload``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if config.cpu_offload and device.type != "cuda":
        raise ValueError("cpu_offload=True offloads from a GPU; use device='cuda' or drop it")
    if config.compile_layers and device.type != "cuda":
        raise ValueError("compile_layers=True compiles for a GPU; use device='cuda' or drop it")
    world = torch.distributed.get_world_size()
    if config.activation_checkpointing:
        enable_activation_checkpointing(model)
    if blocks_compiled(config, device):
        # Flex keeps its own compiled kernel per bucket (traced with dynamic shapes it failed).
        compile_blocks(model, attention=config.compile_attention and config.attention != "flex")
    if config.compile_layers:
        for layer in decoder_layers(model):
            # In place (parameter names unchanged); dynamic: micro-batch lengths vary.
            layer.compile(dynamic=True)
    if not uses_fsdp(config, world, device):
        move_buffers(model, device)  # parameters move with rl_fsdp.master.MasterWeights
        return model
    mesh = init_device_mesh(device.type, (world,))
    mixed = MixedPrecisionPolicy(
        param_dtype=DTYPES[config.precision], reduce_dtype=reduce_dtype(config, world)
    )
    kwargs = {"mesh": mesh, "mp_policy": mixed}
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    elif device.type == "cuda":
        model.to(device)
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward(config, world), **kwargs)
    # The root (embeddings, head) is needed again first thing in backward: keep it gathered.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Every module buffer (rotary frequencies, ...) to ``device``, parameters left where
    they are (a full float32 copy of them on the device would only be transient)."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(device)


def compute_params_only(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Parameters to ``device`` in ``dtype``; buffers to ``device`` in their own dtype (the
    rotary frequencies stay float32, as under FSDP's mixed precision)."""
    for param in model.parameters():
        param.data = param.data.to(device, dtype)
    move_buffers(model, device)


def place_adapted(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """One rank without FSDP, with LoRA: the frozen base to ``device`` in the compute
    ``dtype`` (it never changes, so no float32 master and no gradient buffers), the
    trainable adapters in float32 (what the optimizer updates), buffers as they are."""
    for param in model.parameters():
        param.data = param.data.to(device, torch.float32 if param.requires_grad else dtype)
    move_buffers(model, device)


def uses_fsdp(config: FSDPConfig, world_size: int, device: torch.device) -> bool:
    """Whether the model is sharded with FSDP2: with more than one rank, and on one rank
    when ``fsdp_on_one_rank`` (None: only with ``cpu_offload``, FSDP2's offload policy).
    One CPU rank trains the plain module too: FSDP2's per-layer gathers and DTensor
    optimizer step took a tiny model's step from about 25 to 45 ms (issue 21), for the
    same numbers (``tests/test_fsdp_master.py``)."""
    if world_size > 1:
        return True
    if config.fsdp_on_one_rank is not None:
        return config.fsdp_on_one_rank
    return config.cpu_offload


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard_all(model: nn.Module) -> None:
    """Free every gathered FSDP unit of ``model`` (``FSDPModule.reshard`` is not recursive;
    layers stay gathered after a no-grad forward when ``reshard_after_forward`` is False)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def blocks_compiled(config: FSDPConfig, device: torch.device) -> bool:
    """Whether MLPs and norms get compiled: ``compile_blocks``, or by default on CUDA
    unless the layers are checkpointed or compiled whole."""
    if config.compile_blocks is not None:
        return config.compile_blocks
    return device.type == "cuda" and not (config.activation_checkpointing or config.compile_layers)


def reshard_after_forward(config: FSDPConfig, world_size: int) -> bool:
    """``reshard_after_forward``, by default False on a single rank without CPU offload."""
    if config.reshard_after_forward is not None:
        return config.reshard_after_forward
    return world_size > 1 or config.cpu_offload


def reshard_after_backward(config: FSDPConfig, world_size: int) -> bool:
    """Whether layers are freed after every micro-batch's backward; by default only when
    they are also freed after forward (without it: on one rank, the layers stay gathered
    through a step's micro-batches and are freed once after the last one)."""
    if config.reshard_after_backward is not None:
        return config.reshard_after_backward
    return reshard_after_forward(config, world_size)


@contextmanager
def gathered_through(model: nn.Module, keep: bool):
    """Within: FSDP units of ``model`` stay gathered after backward when ``keep`` (the
    next micro-batch's forward needs no new all-gather and bf16 cast of the same
    weights); on exit every unit is resharded, so the optimizer updates the sharded
    parameters and the next gather sees the update."""
    if not keep or not is_fsdp(model):
        yield
        return
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_reshard_after_backward(True)
        reshard_all(model)


def reduce_dtype(config: FSDPConfig, world_size: int) -> torch.dtype:
    """The gradient reduction dtype, by default fp32 (the compute dtype on a single rank)."""
    if config.reduce_dtype is not None:
        return DTYPES[config.reduce_dtype]
    return DTYPES[config.precision] if world_size == 1 else torch.float32


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every decoder layer in backward (non-reentrant), on transformers versions
    before and after ``gradient_checkpointing_enable`` was renamed."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def freeze_by_name(model: nn.Module, train_only=(), freeze=()) -> None:
    """Turn off ``requires_grad`` of the parameters the patterns do not train
    (rl_core.freezing; names as Hugging Face writes them). A pattern matching no
    parameter raises ValueError."""
    if not train_only and not freeze:
        return
    names = [name for name, _ in model.named_parameters()]
    check_patterns(names, train_only=train_only, freeze=freeze, prefix="FSDPConfig.")
    for name, param in model.named_parameters():
        if not is_trained(name, train_only, freeze):
            param.requires_grad_(False)


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
