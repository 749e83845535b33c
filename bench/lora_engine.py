"""Decode cost of per-request LoRA on the embedded engine: the same greedy batch with no
adapter (the baseline, on an engine without --enable-lora), every row on one adapter, half
the rows on it and half on the base, and the rows spread over four adapters.

    uv run --package rl-sglang python bench/lora_engine.py [--rows 32] [--tokens 32] \
        [--rank 8] [--hidden 256] [--layers 4] [--repeats 3]

A Qwen2-shaped model with random weights (``--hidden``, ``--layers``) in float32 on CPU,
adapters of ``--rank`` on every attention and MLP projection. Each arm runs ``--repeats``
times after one warm-up; prints one JSON object with the median tokens/s of each arm,
its ratio to the baseline, the hardware and the command.
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rl_sglang.engine.core import Engine
from rl_sglang.engine.lora import random_adapter, save_peft_adapter
from rl_sglang.tiny import byte_tokenizer, random_model, tiny_config

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model, path: Path, rank: int, seed: int) -> str:
    """A PEFT directory of random rank-``rank`` adapters on every targeted Linear."""
    adapter = random_adapter(model, rank=rank, targets=TARGETS, seed=seed, scale=0.05)
    return save_peft_adapter(path, adapter, rank=rank, alpha=2 * rank)


async def tokens_per_s(engine: Engine, body: dict, repeats: int) -> float:
    """Median generated tokens per second of ``body`` over ``repeats`` runs (one warm-up)."""
    rates = []
    for attempt in range(repeats + 1):
        groups, _ = engine.make_requests(body)
        start = time.perf_counter()
        outs = await engine.run([r for group in groups for r in group])
        seconds = time.perf_counter() - start
        if attempt:
            rates.append(sum(len(o["output_ids"]) for o in outs) / seconds)
    return statistics.median(rates)


async def measure(args) -> dict:
    config = tiny_config(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32,
        num_key_value_heads=max(1, args.hidden // 64),
    )
    model = random_model(config, seed=0)
    prompts = [[(7 * row + i) % 250 for i in range(16)] for row in range(args.rows)]
    params = {"max_new_tokens": args.tokens, "temperature": 0.0, "ignore_eos": True}
    body = {"input_ids": prompts, "sampling_params": params}
    plain = Engine(model, byte_tokenizer(), max_batch_size=args.rows, runner="dynamic")
    results = {"base (no --enable-lora)": await tokens_per_s(plain, body, args.repeats)}
    plain.scheduler.stop()
    engine = Engine(model, byte_tokenizer(), max_batch_size=args.rows, enable_lora=True)
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(4):
            path = write_adapter(model, Path(tmp) / f"a{index}", args.rank, seed=index)
            await engine.load_lora_adapter({"lora_name": f"a{index}", "lora_path": path})
    half = ["a0" if row % 2 else None for row in range(args.rows)]
    arms = {
        "enable-lora, base rows": None,
        "one adapter, all rows": "a0",
        "one adapter, half the rows": half,
        "four adapters": [f"a{row % 4}" for row in range(args.rows)],
    }
    for name, lora_path in arms.items():
        results[name] = await tokens_per_s(engine, body | {"lora_path": lora_path}, args.repeats)
    engine.scheduler.stop()
    baseline = results["base (no --enable-lora)"]
    return {
        "tokens_per_s": results,
        "over_base": {name: rate / baseline for name, rate in results.items()},
        "settings": vars(args),
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "command": " ".join(["python bench/lora_engine.py", *sys.argv[1:]]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    print(json.dumps(asyncio.run(measure(parser.parse_args())), indent=2))


if __name__ == "__main__":
    main()
