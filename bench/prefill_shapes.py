"""Prefill attention at prompt counts the device has not seen: first and second call.

The embedded engine prefills whatever number of prompts has arrived, so a rollout brings
new shapes. On Hopper SDPA picks cuDNN's fused attention, which builds a plan per new shape;
the engine's prefill restricts SDPA to flash / memory-efficient / math
(``rl_sglang.engine.layers.PREFILL_ATTENTION``). This times, for row counts never used
before in the process, SDPA with its default choice against that restriction, and the
engine's whole prefill layer (which applies it), on the Qwen2.5-0.5B layer shape.

    python bench/prefill_shapes.py --out result.json      # CUDA
"""

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from report import write_report
from torch.nn.attention import sdpa_kernel

from rl_sglang.engine.layers import PREFILL_ATTENTION, prefill_layer

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 896, 4864, 14, 2, 64


def milliseconds(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) * 1e3, 3)


def attention_call(rows: int, length: int, restricted: bool):
    q = torch.randn(rows, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(rows, KV_HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

    def call():
        if restricted:
            with sdpa_kernel(PREFILL_ATTENTION):
                F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        else:
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)

    return call


def layer_call(rows: int, length: int, weights: tuple):
    hidden = torch.randn(rows, length, HIDDEN, device="cuda", dtype=torch.bfloat16)
    cos = torch.ones(1, length, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    sin = torch.zeros_like(cos)
    return lambda: prefill_layer(hidden, weights, cos, sin, 1e-6, HEADS, HEAD_DIM)


def layer_weights() -> tuple:
    def w(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02

    ones = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return (
        ones,
        ones,
        w(qkv_rows, HIDDEN),
        w(qkv_rows),
        w(HIDDEN, HEADS * HEAD_DIM),
        None,
        w(2 * INTERMEDIATE, HIDDEN),
        None,
        w(HIDDEN, INTERMEDIATE),
        None,
    )


def first_and_second(make, rows_list: list[int]) -> list[dict]:
    out = []
    for rows in rows_list:
        call = make(rows)
        out.append({"rows": rows, "first_ms": milliseconds(call), "second_ms": milliseconds(call)})
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8, help="prompt tokens (the quickstart's)")
    parser.add_argument("--counts", type=int, default=5, help="new row counts per variant")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    weights, length = layer_weights(), args.length
    with torch.inference_mode():
        for warm in (attention_call(1024, length, False), attention_call(1024, length, True)):
            warm()  # the kernels' own one-time start-up, before any timed shape
        layer_call(1024, length, weights)()
        step = iter(range(16 + 16, 16 * 1000, 16))  # each variant gets row counts unseen so far
        counts = {name: [next(step) for _ in range(args.counts)] for name in ("a", "b", "c")}
        result = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "length": length,
            "sdpa_default": first_and_second(
                lambda n: attention_call(n, length, False), counts["a"]
            ),
            "sdpa_prefill_backends": first_and_second(
                lambda n: attention_call(n, length, True), counts["b"]
            ),
            "prefill_layer": first_and_second(
                lambda n: layer_call(n, length, weights), counts["c"]
            ),
        }
    print(json.dumps(result, indent=1))
    if args.out:
        write_report(result, args.out)
    return result


if __name__ == "__main__":
    main()
