"""``engine.quantization: fp8`` (FP8 rollout): what it cannot go with, refused before Ray
starts."""

from rl_launcher.config import TrainConfig
from rl_launcher.infra.weight_sync import resolve_transport


def check_fp8_rollout(config: TrainConfig) -> None:
    if config.engine.quantization != "fp8" or config.mode != "rl":
        return
    if config.model.lora_rank:
        raise ValueError(
            "engine.quantization=fp8 quantises full weights at every sync, and "
            f"model.lora_rank={config.model.lora_rank} trains adapters the engines apply over "
            "their base; set engine.quantization=none or model.lora_rank=0"
        )
    transport = resolve_transport(
        config.engine.weight_sync, colocate=config.cluster.colocate, device=config.cluster.device
    )
    if transport == "distributed" and not config.engine.weight_flatten:
        raise ValueError(
            "engine.quantization=fp8 with weight_sync=distributed broadcasts float8 tensors, "
            "which gloo (and older NCCL) cannot; keep engine.weight_flatten=true (one uint8 "
            "buffer per bucket)"
        )
    if config.engine.kind == "sglang":
        _check_sglang_blocks(config)


def _check_sglang_blocks(config: TrainConfig) -> None:
    """SGLang's FP8 linear layers need every merged part (q, k, v; gate, up) and every
    tensor-parallel slice to fill whole 128-wide blocks."""
    from rl_core.fp8 import BLOCK_SIZE  # torch: only for engine.quantization=fp8
    from rl_launcher.config.switch_checks import policy_hf_config

    hf = policy_hf_config(config)
    tp, block = config.engine.devices_per_engine, BLOCK_SIZE[0]
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    widths = {
        "num_attention_heads x head_dim": hf.num_attention_heads * head_dim,
        "num_key_value_heads x head_dim": kv_heads * head_dim,
        "intermediate_size": getattr(hf, "intermediate_size", None),
        "moe_intermediate_size": getattr(hf, "moe_intermediate_size", None),
    }
    bad = {name: width for name, width in widths.items() if width and (width // tp) % block}
    if bad:
        shown = ", ".join(f"{name} = {width}" for name, width in bad.items())
        raise ValueError(
            f"engine.quantization=fp8 with engine.kind=sglang: SGLang's FP8 layers need each "
            f"of these widths divided by the engine's TP size ({tp}) to be a multiple of "
            f"{block}, and {shown} is not; use engine.kind=embedded (any shape) or "
            "engine.quantization=none"
        )
