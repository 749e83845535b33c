"""Run by test_decode_attention.py with TRITON_INTERPRET=1 (Triton's kernels executed on
the CPU): the decode-attention kernels against SDPA with a length mask, and the static
runner's greedy decoding with them against the same runner with SDPA. Prints one JSON
object."""

import json

import torch

from rl_sglang.engine import decode_attention as decode_attention_module
from rl_sglang.engine.decode_attention import decode_attention
from rl_sglang.engine.layers import attend
from rl_sglang.engine.static import StaticRunner
from rl_sglang.tiny import random_model, tiny_config

# (rows, query heads, KV heads, head dim, cache rows, each row's length)
CASES = [
    (3, 14, 2, 64, 272, [1, 200, 272]),  # Qwen2.5-0.5B's grouping; a full and a 1-token row
    (2, 9, 3, 64, 48, [17, 48]),  # SmolLM2-135M's grouping
    (4, 4, 4, 16, 32, [1, 2, 31, 32]),  # no grouping, head dim 16
    (1, 8, 1, 32, 640, [513]),  # one KV head, chunks longer than one block
    (2, 20, 1, 48, 80, [33, 80]),  # 20 query heads a KV head, head dim not a power of two
]


def kernel_error(rows, heads, kv_heads, head_dim, cache_rows, lengths) -> float:
    gen = torch.Generator().manual_seed(rows * 31 + heads)
    keys = torch.randn(rows + 1, kv_heads, cache_rows, head_dim, generator=gen)  # a spare slot
    values = torch.randn(rows + 1, kv_heads, cache_rows, head_dim, generator=gen)
    q = torch.randn(rows, heads + kv_heads, head_dim, generator=gen)[:, :heads]  # a view
    positions = torch.tensor(lengths) - 1
    hidden = torch.arange(cache_rows)[None] > positions[:, None]
    mask = torch.where(hidden, float("-inf"), 0.0)[:, None, None]
    want = attend(q, keys[:rows], values[:rows], mask)
    got = decode_attention(q, keys, values, positions)
    assert got.shape == want.shape and got.dtype == want.dtype
    return (got - want).abs().max().item()


def greedy_run(model, attention: str) -> dict:
    """Prefill four prompts, decode, drop two rows (slots move), decode on; two chunks per
    row (the interpreter runs every program one after another)."""
    decode_attention_module.SPLITS = 2
    runner = StaticRunner(model, max_slots=4, max_len=96, attention=attention)
    logits, state = runner.prefill([[1, 2, 3], [9] * 40, [5], [7, 8] * 20])
    state = runner.merge(None, state)
    tokens, steps, logits_seen = logits.argmax(-1), [], []
    for step in range(6):
        if step == 3:
            state = runner.select(state, [3, 1])
            tokens = tokens[[3, 1]]
        logits = runner.decode(state, tokens)
        logits_seen.append(logits.clone())
        tokens = logits.argmax(-1)
        steps.append(tokens.tolist())
    return {"fused": runner.fused_attention, "steps": steps, "logits": logits_seen}


def main() -> None:
    errors = [kernel_error(*case) for case in CASES]
    model = random_model(tiny_config(num_attention_heads=4, num_key_value_heads=2), seed=3)
    fused, sdpa = greedy_run(model, "triton"), greedy_run(model, "sdpa")
    logits_error = max(
        (a - b).abs().max().item() for a, b in zip(fused["logits"], sdpa["logits"], strict=True)
    )
    print(
        json.dumps(
            {
                "kernel_errors": errors,
                "fused": [fused["fused"], sdpa["fused"]],
                "same_tokens": fused["steps"] == sdpa["steps"],
                "logits_error": logits_error,
            }
        )
    )


if __name__ == "__main__":
    main()
