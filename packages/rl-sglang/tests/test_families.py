"""The model families users bring (docs/models.md) in the embedded engine, each built from
its transformers config (hidden 64, 2 layers, vocab 320, random weights): sampled
log-probs equal a teacher-forced forward of the HF model with eager attention (fp32,
|Δ| <= 1e-4), on the dynamic runner for every family and the static one for the
Llama-family; the static runner refuses what it would compute wrongly, naming it."""

import copy

import pytest
import torch

from conftest import generate, teacher_forced_logprobs
from rl_sglang.engine.core import Engine
from rl_sglang.tiny import byte_tokenizer, random_model, tiny_config

WINDOW = 6  # shorter than prompt + output below, so an ignored window would show
FAMILIES = {
    "llama": {"model_type": "llama"},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "mistral": {"model_type": "mistral", "sliding_window": None},
    "mistral-window": {"model_type": "mistral", "sliding_window": WINDOW},
    "glm4": {"model_type": "glm4", "head_dim": 16, "partial_rotary_factor": 0.5},
    "deepseek_v3": {
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 24,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "num_nextn_predict_layers": 0,
    },
    "gemma": {"model_type": "gemma", "head_dim": 16},
    "gemma2": {
        "model_type": "gemma2",
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": WINDOW,
        "attn_logit_softcapping": 5.0,
    },
    "gemma3_text": {"model_type": "gemma3_text", "head_dim": 16, "sliding_window": WINDOW},
}
STATIC = ["llama", "qwen2", "mistral"]
PROMPTS = [[1, 2, 3], [9] * 11, [5], [7, 8], [100, 101, 102, 103, 104]]


def family_model(family: str, *, seed: int = 3, **overrides):
    """A random fp32 model of ``family`` (Qwen2-shaped sizes of :mod:`rl_sglang.tiny`);
    the weights depend on the seed only, not on ``overrides`` of window or softcap."""
    from transformers import AutoConfig

    fields = {**FAMILIES[family], **overrides}
    base = tiny_config(max_position_embeddings=256).to_dict()
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "eos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
    )
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **{**{k: base[k] for k in keep}, **fields})
    return random_model(config, seed=seed)


def runner_cases():
    return [(f, "dynamic") for f in FAMILIES] + [(f, "static") for f in STATIC]


@pytest.mark.parametrize(("family", "runner"), runner_cases())
def test_engine_log_probs_equal_teacher_forcing(family, runner):
    model = family_model(family)
    reference = copy.deepcopy(model)
    reference.config._attn_implementation = "eager"  # Hugging Face's plain maths
    engine = Engine(model, byte_tokenizer(), max_batch_size=4, runner=runner, max_context=256)
    try:
        params = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True}
        outs = generate(engine, input_ids=PROMPTS, sampling_params=params, return_logprob=True)
    finally:
        engine.scheduler.stop()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        got = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        expected = teacher_forced_logprobs(reference, prompt, out["output_ids"])
        assert got == pytest.approx(expected, abs=1e-4), (prompt, got, expected)


@pytest.mark.parametrize(
    ("family", "reason"),
    [
        ("mistral-window", "mistral sliding-window attention (sliding_window=6 < context 256)"),
        ("qwen3_moe", "model_type 'qwen3_moe' is not one of"),
        ("gemma2", "model_type 'gemma2' is not one of"),
        ("glm4", "glm4 (output norms after attention and MLP"),
        ("deepseek_v3", "deepseek_v3 (multi-latent attention"),
    ],
)
def test_static_runner_refuses_what_it_cannot_compute(family, reason):
    with pytest.raises(ValueError, match="use dynamic") as error:
        Engine(family_model(family), byte_tokenizer(), runner="static", max_context=256)
    assert reason in str(error.value)


def test_a_window_longer_than_the_context_takes_the_static_runner():
    """Mistral v0.1's 4096-token window never binds when the engine serves fewer tokens."""
    model = family_model("mistral-window")
    engine = Engine(model, byte_tokenizer(), runner="static", max_context=WINDOW)
    engine.scheduler.stop()
    assert engine.runner_kind == "static"


@pytest.mark.parametrize(
    ("family", "without"),
    [
        ("mistral-window", {"sliding_window": None}),
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma2", {"sliding_window": 10_000}),
        ("gemma3_text", {"sliding_window": 10_000}),
    ],
)
def test_the_window_and_softcap_change_these_models(family, without):
    """A control: without their window (or softcap) these models give other logits, so
    the engine test above would catch a runner that ignored them."""
    ids = torch.tensor([PROMPTS[1] + list(range(20, 30))])
    exact, plain = family_model(family), family_model(family, **without)
    for model in (exact, plain):
        model.config._attn_implementation = "eager"
    with torch.no_grad():
        assert float((exact(ids).logits - plain(ids).logits).abs().max()) > 1e-3


def test_checkpoint_named_expert_weights_update_a_fused_moe_engine(tmp_path):
    """Trainers send Qwen3-MoE experts under a checkpoint's per-expert names (Megatron's
    export, SGLang's loader); the engine's transformers model keeps them fused. An update
    from a saved checkpoint fills the right parts: the model then equals the new one."""
    from rl_sglang.engine import weights

    engine_model, new = family_model("qwen3_moe"), family_model("qwen3_moe", seed=4)
    new.save_pretrained(tmp_path)
    named = weights.read_safetensors_dir(tmp_path)
    assert "model.layers.0.mlp.experts.2.gate_proj.weight" in dict(named)
    assert weights.copy_into_model(engine_model, named) == len(named)
    expected = new.state_dict()
    for name, tensor in engine_model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    bad = [("model.layers.0.mlp.experts.4.down_proj.weight", torch.zeros(64, 32))]
    with pytest.raises(ValueError, match="unknown weight"):  # expert 4 of 4
        weights.copy_into_model(engine_model, bad)
