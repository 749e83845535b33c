"""Tiny models, a deterministic batch and the plain (unsharded, padded) reference maths the
tests compare the backend with."""

import torch

from rl_core.batch import TrainBatch, next_token_targets
from rl_core.packing import cu_seqlens_from_lengths, pack, pad_packed

VOCAB = 512
COMMON = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
}
CONFIGS = {
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True, **COMMON},
    "qwen3": {"model_type": "qwen3", "head_dim": 16, **COMMON},
    "llama": {"model_type": "llama", "tie_word_embeddings": False, **COMMON},
}
LENGTHS = [9, 17, 5, 12, 20, 8, 14, 11, 16, 6]
# The families users bring (docs/models.md). Sliding windows of 6 tokens, shorter than most
# of LENGTHS, so that a window the packed attention ignored would show; Gemma2's attention
# softcap small enough to bite at these scores (its released value, 50, never would).
WINDOW = 6
FAMILIES = {
    "llama": CONFIGS["llama"],
    "qwen2": CONFIGS["qwen2"],
    "qwen3": CONFIGS["qwen3"],
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        **COMMON,
    },
    "mistral": {"model_type": "mistral", "sliding_window": WINDOW, **COMMON},
    "gemma": {"model_type": "gemma", "head_dim": 16, **COMMON},
    "gemma2": {
        "model_type": "gemma2",
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": WINDOW,
        "attn_logit_softcapping": 0.02,
        **COMMON,
    },
    "gemma3_text": {
        "model_type": "gemma3_text",
        "head_dim": 16,
        "sliding_window": WINDOW,
        **COMMON,
    },
}


def plain_model(
    model_config: dict, *, seed: int = 0, head: str = "causal_lm", attention: str = "sdpa"
):
    """The unsharded HF model with stock ``attention`` (SDPA; "eager" for what SDPA
    cannot do, e.g. Gemma2's softcap), built as the backend builds it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    fields = dict(model_config)
    extra = {"num_labels": 1, "classifier_dropout": 0.0} if head == "value" else {}
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields, **extra)
    auto = AutoModelForCausalLM if head == "causal_lm" else AutoModelForTokenClassification
    torch.manual_seed(seed)
    return auto.from_config(cfg, attn_implementation=attention, dtype=torch.float32)


def tokens_batch(lengths=LENGTHS, seed: int = 0) -> TrainBatch:
    """Random tokens; loss on every position but the first two and the last of each."""
    gen = torch.Generator().manual_seed(seed)
    cu = cu_seqlens_from_lengths(lengths)
    tokens = torch.randint(0, VOCAB, (int(cu[-1]),), generator=gen)
    mask = torch.ones(tokens.shape[0])
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        mask[start : start + 2] = 0.0
        mask[end - 1] = 0.0
    return TrainBatch(tokens=tokens, cu_seqlens=cu, loss_mask=mask)


def padded_logits(model, batch: TrainBatch) -> torch.Tensor:
    """Packed ``[N, V]`` logits from an ordinary right-padded forward with attention_mask."""
    padded, mask = pad_packed(batch.tokens, batch.cu_seqlens)
    out = model(input_ids=padded, attention_mask=mask.long(), use_cache=False)
    return pack(out.logits, mask)[0]


def padded_log_probs(model, batch: TrainBatch, temperature: float = 1.0) -> torch.Tensor:
    """Plain log_softmax log-probs ``[N]`` of the next tokens (0 at sequence ends)."""
    logits = padded_logits(model, batch).float() / temperature
    targets = next_token_targets(batch.tokens, batch.cu_seqlens)
    lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    ends = batch.cu_seqlens[1:].long() - 1
    return lp.index_fill(0, ends, 0.0)
