"""megatron-core options by name: ``MegatronConfig.megatron`` maps a field of megatron-core's
``TransformerConfig``, ``DistributedDataParallelConfig`` or ``OptimizerConfig`` to a value.

    split_options({"recompute_granularity": "full", "recompute_method": "uniform",
                   "recompute_num_layers": 1, "use_distributed_optimizer": False})
    -> MegatronOptions(transformer={"recompute_...": ...}, distributed_optimizer=False)

TransformerConfig fields go into the model's TransformerConfig as given (megatron checks
their values when the model is built). The fields this backend sets itself are refused,
naming the MegatronConfig field that sets them (:data:`OWNED`). rl-megatron reduces
gradients and steps its optimizer itself rather than through megatron's DDP and optimizer
wrappers, so of those two dataclasses only ``use_distributed_optimizer`` (ZeRO-1 over
data-parallel ranks) and the fields an rl-megatron option sets mean something here; the
others are refused rather than ignored.
"""

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

HF = "hf_path"  # the model's shape comes from its HF config
FIXED = None  # rl-megatron relies on this value

# megatron-core field -> the MegatronConfig field that sets it (HF: the HF config; FIXED:
# this backend's forward, loss or gradient handling depends on its value)
OWNED: dict[str, str | None] = {
    "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp",
    "context_parallel_size": "cp",
    "expert_model_parallel_size": "ep",
    "sequence_parallel": "sequence_parallel",
    "params_dtype": "precision",
    "pipeline_dtype": "precision",
    "bf16": "precision",
    "fp16": "precision",
    "bias_activation_fusion": "swiglu_fusion",
    "fused_single_qkv_rope": "fused_qkv_rotary",
    "lr": "lr",
    "min_lr": "min_lr_ratio",
    "weight_decay": "weight_decay",
    "adam_beta1": "adam_betas",
    "adam_beta2": "adam_betas",
    "adam_eps": "adam_eps",
    "clip_grad": "clip_grad",
    **dict.fromkeys(
        (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "ffn_hidden_size",
            "normalization",
            "layernorm_epsilon",
            "gated_linear_unit",
            "activation_func",
            "add_bias_linear",
            "add_qkv_bias",
            "qk_layernorm",
            "num_moe_experts",
            "moe_ffn_hidden_size",
            "moe_router_topk",
            "moe_router_pre_softmax",
        ),
        HF,
    ),
    **dict.fromkeys(
        (
            "calculate_per_token_loss",  # losses carry global denominators
            "variable_seq_lengths",  # False: every stage knows each activation shape
            "use_cpu_initialization",  # weights are loaded into each shard
            "perform_initialization",
            "gradient_accumulation_fusion",  # needs megatron DDP's main_grad buffers
            "apply_rope_fusion",  # needs Transformer Engine
            "moe_token_dispatcher_type",  # allgather
            "moe_router_load_balancing_type",  # no auxiliary loss is trained
            "moe_aux_loss_coeff",
            "moe_grouped_gemm",
            "optimizer",  # AdamW
        ),
        FIXED,
    ),
}
# TransformerConfig fields whose feature this backend does not run: refused, saying why
UNSUPPORTED = {
    "fp8": "FP8 needs Transformer Engine layers, which this backend does not build",
    "fp4": "FP4 needs Transformer Engine layers, which this backend does not build",
    "mtp_num_layers": "multi-token prediction layers have no HF weights or loss here",
}
# DDP / optimizer fields that mean something here, and the MegatronConfig field they set
ROUTED = {
    "use_distributed_optimizer": "distributed_optimizer",
    "virtual_pipeline_model_parallel_size": "vpp",  # model chunks per pipeline stage
}


@dataclasses.dataclass(frozen=True)
class MegatronOptions:
    transformer: dict[str, Any]
    """TransformerConfig keyword arguments."""
    routed: dict[str, Any]
    """MegatronConfig fields set through a megatron-core name (:data:`ROUTED`)."""


def option_classes() -> dict[str, type]:
    """megatron-core's option dataclasses by name (imported here: megatron is heavy)."""
    from megatron.core.distributed.distributed_data_parallel_config import (
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    return {
        "TransformerConfig": TransformerConfig,
        "DistributedDataParallelConfig": DistributedDataParallelConfig,
        "OptimizerConfig": OptimizerConfig,
    }


def _fields_by_class() -> dict[str, set[str]]:
    return {
        name: {f.name for f in dataclasses.fields(cls) if f.init}
        for name, cls in option_classes().items()
    }


def split_options(
    options: Mapping[str, Any], *, where: str = "MegatronConfig.megatron", owners=None
) -> MegatronOptions:
    """``options`` checked against megatron-core's dataclasses and split by destination.

    ``where`` names the mapping in messages; ``owners`` maps a MegatronConfig field to the
    option a user sets it with (default: ``MegatronConfig.<field>``). Raises ValueError for
    an unknown name (with the closest known ones), a field this backend sets itself, and a
    DDP / optimizer field that would have no effect."""
    if not options:  # nothing to check: megatron-core is not imported
        return MegatronOptions(transformer={}, routed={})
    owners = owners or {}
    fields = _fields_by_class()
    transformer, routed = {}, {}
    for name, value in options.items():
        holders = [cls for cls, names in fields.items() if name in names]
        if not holders:
            raise ValueError(_unknown(name, fields, where))
        if name in OWNED:
            raise ValueError(_owned(name, holders[0], where, owners))
        if name in UNSUPPORTED:
            raise ValueError(
                f"{where}: {name!r} is not supported by rl-megatron: {UNSUPPORTED[name]}"
            )
        if name in ROUTED:
            routed[ROUTED[name]] = value
        elif "TransformerConfig" in holders:
            transformer[name] = value
        else:
            raise ValueError(
                f"{where}: {name!r} is a {holders[0]} field, but rl-megatron reduces gradients "
                "and steps AdamW itself (not through megatron's DDP and optimizer wrappers), "
                "so it would have no effect; of those two only use_distributed_optimizer applies"
            )
    return MegatronOptions(transformer=transformer, routed=routed)


def _unknown(name: str, fields: dict[str, set[str]], where: str) -> str:
    every = {field: cls for cls, names in fields.items() for field in names}
    close = difflib.get_close_matches(name, list(every), n=3)
    hint = (
        "; did you mean " + " or ".join(f"{c!r} ({every[c]})" for c in close)
        if close
        else "; see megatron.core's TransformerConfig"
    )
    return (
        f"{where}: {name!r} is not a field of megatron-core's TransformerConfig, "
        f"DistributedDataParallelConfig or OptimizerConfig{hint}"
    )


def _owned(name: str, holder: str, where: str, owners: Mapping[str, str]) -> str:
    owner = OWNED[name]
    if owner is FIXED:
        return (
            f"{where}: {holder}.{name} is fixed by rl-megatron (its model and training rely on it)"
        )
    option = owners.get(owner, f"MegatronConfig.{owner}")
    if owner == HF:
        return f"{where}: {holder}.{name} comes from the model's HF config ({option})"
    return f"{where}: {holder}.{name} is set by rl-megatron; use {option} instead"
