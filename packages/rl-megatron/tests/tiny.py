"""Tiny HF models and packed batches shared by the tests (built from configs, no downloads)."""

import itertools
from pathlib import Path

import torch

from rl_core.batch import TrainBatch
from rl_core.packing import cu_seqlens_from_lengths

VOCAB = 500  # not a multiple of 128: exercises Megatron's vocabulary padding


# llama3 rope with a short original context, so that scaled frequencies show at test lengths
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


# MLA (query latent 32, kv latent 24, 16 + 8 rope channels per query/key head, values 16)
# and, after one dense layer, 8 routed experts in 4 groups (top 2 groups, top 4 experts)
# plus a shared one: a DeepSeek-V3 at the tiny size.
DEEPSEEK_V3 = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    moe_intermediate_size=32,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_nextn_predict_layers=0,
)


# DeepSeek-V3's YaRN (its released factor is 40 over 4096 tokens) over 16 tokens here, so
# that the scaled frequencies and attention factors act on the test rows
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def hf_config(family: str, *, tie: bool = False, **overrides):
    """A tiny config (hidden 64, 2 layers, vocab 500) of ``family``: a model_type, or
    ``llama3-rope`` (Llama 3.1's scaled rope), ``deepseek_v3-yarn``."""
    import transformers

    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        intermediate_size=128,
        tie_word_embeddings=tie,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    extra = {
        "qwen3": dict(head_dim=16),
        # 4 experts, top-2, renormalised like the released models
        "qwen3_moe": dict(
            head_dim=16,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
        "mistral": dict(sliding_window=None),
        "llama3-rope": dict(rope_parameters=LLAMA3_ROPE),
        # partial interleaved rope on 8 of 16 channels, qkv bias, output norms, fused gate/up
        "glm4": dict(
            head_dim=16, partial_rotary_factor=0.5, attention_bias=True, pad_token_id=None
        ),
        "deepseek_v3": DEEPSEEK_V3,
        "deepseek_v3-yarn": DEEPSEEK_V3 | {"rope_parameters": DEEPSEEK_YARN},
        "deepseek_v3-dense": DEEPSEEK_V3 | {"first_k_dense_replace": 3},  # MLA, no experts
        "deepseek_v3-4layers": DEEPSEEK_V3 | {"num_hidden_layers": 4},  # two per stage at pp=2
        "gemma": dict(head_dim=16),
        "gemma2": dict(head_dim=16),
        "gemma3_text": dict(head_dim=16),
    }.get(family, {})
    classes = {
        "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config",
        "qwen3_moe": "Qwen3MoeConfig",
        "llama": "LlamaConfig",
        "llama3-rope": "LlamaConfig",
        "mistral": "MistralConfig",
        "glm4": "Glm4Config",
        "deepseek_v3": "DeepseekV3Config",
        "deepseek_v3-yarn": "DeepseekV3Config",
        "deepseek_v3-dense": "DeepseekV3Config",
        "deepseek_v3-4layers": "DeepseekV3Config",
        "gemma": "GemmaConfig",
        "gemma2": "Gemma2Config",
        "gemma3_text": "Gemma3TextConfig",
    }
    return getattr(transformers, classes[family])(**{**common, **extra, **overrides})


def save_tiny_model(directory: Path, family: str, *, tie: bool = False, seed: int = 0, **overrides):
    """An fp32 HF model with random weights (norms and biases perturbed so that a wrong
    mapping shows), saved as safetensors under ``directory``; returns it in eval mode.
    ``overrides``: config fields (as :func:`hf_config`'s)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        hf_config(family, tie=tie, **overrides), dtype=torch.float32
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # as large as the scores' spread
                buffer.copy_(0.03 * torch.randn_like(buffer))
    model.save_pretrained(str(directory))
    return model.eval()


def hf_log_probs(model, batch: TrainBatch) -> torch.Tensor:
    """Prediction-at-position log-probs ``[N]`` from the HF model, one sequence at a time
    (0 at sequence ends); differentiable."""
    pieces = []
    bounds = batch.cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        logits = model(batch.tokens[None, start:end]).logits[0].float()
        picked = torch.log_softmax(logits[:-1], -1).gather(1, batch.tokens[start + 1 : end, None])
        pieces += [picked[:, 0], logits.new_zeros(1)]
    return torch.cat(pieces)


def hf_named_grads(model) -> dict[str, torch.Tensor]:
    """Gradients under the names HF saves: fused in-memory expert tensors
    (``experts.gate_up_proj`` [E, 2·I, h], ``experts.down_proj`` [E, h, I]) split per expert."""
    grads = {}
    for name, param in model.named_parameters():
        prefix = name.rsplit(".", 1)[0]
        if name.endswith("experts.gate_up_proj"):
            for e, fused in enumerate(param.grad):
                gate, up = fused.chunk(2)
                grads[f"{prefix}.{e}.gate_proj.weight"] = gate
                grads[f"{prefix}.{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            for e, down in enumerate(param.grad):
                grads[f"{prefix}.{e}.down_proj.weight"] = down
        else:
            grads[name] = param.grad
    return grads


def random_batch(lengths: list[int], *, seed: int = 0, prompt_len: int = 3) -> TrainBatch:
    """Packed batch: random tokens, response mask after ``prompt_len``, random advantages
    and old log-probs near -6 (so PPO ratios are far from 1 and clipping happens)."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lengths)
    mask = torch.zeros(num_tokens)
    start = 0
    for length in lengths:
        mask[start + prompt_len - 1 : start + length - 1] = 1.0
        start += length
    return TrainBatch(
        tokens=torch.randint(0, VOCAB, (num_tokens,), generator=gen),
        cu_seqlens=cu_seqlens_from_lengths(lengths),
        loss_mask=mask,
        advantages=torch.randn(num_tokens, generator=gen),
        old_log_probs=-6.0 + 0.3 * torch.randn(num_tokens, generator=gen),
    ).with_global_denominators()


def hf_files(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in an HF directory."""
    from safetensors.torch import load_file

    tensors = {}
    for path in directory.glob("*.safetensors"):
        tensors.update(load_file(str(path)))
    return tensors
