"""Which exported weights FP8 rollout quantises (rl_core.fp8), on the names rl-fsdp's
exporter gives for Qwen2, Llama and Qwen3-MoE: every attention and MLP projection (each
expert's too), nothing else."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rl_core.fp8 import FP8_DTYPE, is_quantized_weight, quantize_named
from rl_fsdp.weights import iter_weight_buckets

COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    tie_word_embeddings=False,
)
ATTENTION = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
DENSE_MLP = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
EXPERTS = [f"mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]


def exported(model_type: str, **extra) -> list[tuple[str, torch.Tensor]]:
    config = AutoConfig.for_model(model_type, **COMMON, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return [item for bucket in iter_weight_buckets(model, bucket_bytes=1 << 30) for item in bucket]


@pytest.mark.parametrize(
    ("model_type", "extra", "per_layer"),
    [
        ("qwen2", {}, ATTENTION + DENSE_MLP),
        ("llama", {}, ATTENTION + DENSE_MLP),
        (
            "qwen3_moe",
            dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8),
            ATTENTION + EXPERTS,
        ),
    ],
)
def test_quantised_names_per_family(model_type, extra, per_layer):
    named = exported(model_type, **extra)
    quantised = {name for name, t in named if is_quantized_weight(name, t.shape)}
    expected = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in per_layer}
    assert quantised == expected
    kept = {name for name, _ in named} - quantised
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= kept
    if model_type == "qwen3_moe":
        assert "model.layers.0.mlp.gate.weight" in kept  # the router
    sent = dict(quantize_named(named))
    assert {n for n, t in sent.items() if t.dtype == FP8_DTYPE} == expected
    assert {n.removesuffix("_scale_inv") for n in sent if n.endswith("_scale_inv")} == expected
