"""Sampled (temperature 1) decoding on the embedded engine, seeded rows against unseeded:
the rollout's case (rl-train gives every sample a ``sampling_seed``) at a rollout's batch.

    python bench/sampled_decode.py --device cuda --batch 256 --new-tokens 128

A random Qwen2.5-0.5B-shaped model (bench/engine.py's), prompts of ``--prompt-len`` tokens,
``ignore_eos``; each mode runs once untimed (graph capture, warm-up), then timed. Prints one
JSON line: tokens/s per mode and the seeded / unseeded ratio. ``--sampled-multi-step`` also
times seeded decoding on a second engine whose sampled rounds run K steps each
(``Engine(sampled_multi_step=True)``), against the single-step rounds of the first.

    python bench/sampled_decode.py --device cuda --batch 256 --new-tokens 128 --sampled-multi-step
"""

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_model, make_prompts

from rl_sglang.engine.core import Engine


def run_batch(engine: Engine, prompts: list[list[int]], new_tokens: int, seeded: bool) -> float:
    params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}

    async def go():
        bodies = [
            {"input_ids": p, "sampling_params": params | ({"sampling_seed": i} if seeded else {})}
            for i, p in enumerate(prompts)
        ]
        requests = [r for b in bodies for g in engine.make_requests(b)[0] for r in g]
        start = time.perf_counter()
        await engine.run(requests)
        return time.perf_counter() - start

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=["tiny", "qwen2.5-0.5b"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--sampled-multi-step", action="store_true")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = make_model(args.shape, args.device, dtype)
    context = args.prompt_len + args.new_tokens + 8
    engine = Engine(model, None, max_batch_size=args.batch, max_context=context)
    prompts = make_prompts(args.batch, args.prompt_len, model.config.vocab_size, seed=0)
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "runner": engine.runner_kind,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
    }
    for seeded in (False, True):
        run_batch(engine, prompts, args.new_tokens, seeded)  # untimed: capture and warm-up
        seconds = run_batch(engine, prompts, args.new_tokens, seeded)
        mode = "seeded" if seeded else "unseeded"
        result[f"{mode}_tokens_per_s"] = round(args.batch * args.new_tokens / seconds)
    result["seeded_over_unseeded"] = round(
        result["seeded_tokens_per_s"] / result["unseeded_tokens_per_s"], 3
    )
    if args.sampled_multi_step:
        engine.scheduler.stop()
        engine = Engine(
            model, None, max_batch_size=args.batch, max_context=context, sampled_multi_step=True
        )
        run_batch(engine, prompts, args.new_tokens, True)  # untimed: capture and warm-up
        seconds = run_batch(engine, prompts, args.new_tokens, True)
        result["seeded_multi_step_tokens_per_s"] = round(args.batch * args.new_tokens / seconds)
        result["multi_step_over_single_step"] = round(
            result["seeded_multi_step_tokens_per_s"] / result["seeded_tokens_per_s"], 3
        )
    engine.scheduler.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
