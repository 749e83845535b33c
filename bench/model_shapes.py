"""Model shapes shared by the training benchmarks (Qwen2.5 architecture, random weights)."""

QWEN_COMMON = {"vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1e6}
SHAPES = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
    },
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        **QWEN_COMMON,
    },
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        **QWEN_COMMON,
    },
}
