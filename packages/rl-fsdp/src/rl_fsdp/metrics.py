"""Model FLOPs of a training step, for the MFU metric (recomputation not counted).

Matmul FLOPs: 6 per parameter per token (forward 2, backward 4) over the parameters that
take part in matmuls (all but an untied input embedding), plus causal attention:
per layer and sequence of length n, QK^T and AV cost 2·2·n²·d_model/2 forward, ×3 with
the backward: 6·L·d_model·Σn².
"""


def matmul_params(hf_config) -> int:
    """Parameters used in matmuls, from the HF config (decoder families)."""
    hidden, vocab = hf_config.hidden_size, hf_config.vocab_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * hf_config.intermediate_size
    return hf_config.num_hidden_layers * (attn + mlp) + vocab * hidden


def train_flops(hf_config, *, num_tokens: float, attn_tokens_sq: float) -> float:
    """FLOPs of forward + backward over ``num_tokens`` tokens whose sequences' squared
    lengths sum to ``attn_tokens_sq``."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    attn = 6.0 * hf_config.num_hidden_layers * heads * head_dim * attn_tokens_sq
    return 6.0 * matmul_params(hf_config) * num_tokens + attn
