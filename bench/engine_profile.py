"""Kernels per decode step and first-token latency: the embedded engine against SGLang (GPU).

For each batch size: both engines' first-token latency (a 1-token request, seven times) and
tokens/s at 128 new tokens, then a profile of 33 decode tokens and of one first token: the
kernels by GPU time per token, how many per token, and the idle gaps between kernels. The
engine is profiled in-process with torch.profiler; SGLang through its /start_profile
endpoint (a chrome trace per run). Qwen2.5-0.5B shape in bf16, random weights, 128-token
prompts. SGLang's part runs where RL_SGLANG_PYTHONPATH points at an SGLang install.

    python bench/engine_profile.py --batches 1,16 --decode-attention sdpa --out profile.json
"""

import argparse
import asyncio
import glob
import gzip
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict

import torch
from engine import SGLANG_BENCH_ARGS, make_model, make_prompts, run_engine

from rl_sglang.engine.core import Engine

DECODE_TOKENS = 33
ACTIVITIES = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def kernel_table(trace_path: str, label: str, tokens: int) -> None:
    """Print a chrome trace's kernels by GPU time per token and its idle gaps over 50 us."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as trace:
        events = json.load(trace)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        print(label, "no kernels")
        return
    by_name = defaultdict(lambda: [0, 0.0])
    for event in kernels:
        by_name[event["name"][:90]][0] += 1
        by_name[event["name"][:90]][1] += event["dur"]
    busy_ms = sum(e["dur"] for e in kernels) / 1000
    print(f"== {label}: {len(kernels) / tokens:.1f} kernels a token, "
          f"{busy_ms / tokens:.3f} ms of kernel time a token")  # fmt: skip
    for name, (count, dur) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:28]:
        print(f"  {dur / tokens:8.1f} us/token {count / tokens:6.2f}/token  {name}")
    gaps, end = [], kernels[0]["ts"] + kernels[0]["dur"]
    for event in kernels[1:]:
        if event["ts"] - end > 50:
            gaps.append(event["ts"] - end)
        end = max(end, event["ts"] + event["dur"])
    print(f"  idle gaps over 50 us: {len(gaps)}, {sum(gaps) / 1000:.2f} ms in all")


def engine_part(model, batches, attention: str) -> dict:
    engine = Engine(model, None, max_batch_size=64, max_context=128 + 128 + 8,
                    decode_attention=attention)  # fmt: skip
    run_engine(engine, make_prompts(2, 128, model.config.vocab_size, seed=99), 4, "cuda")
    results = {}
    for batch in batches:
        prompts = make_prompts(batch, 128, model.config.vocab_size, batch)
        run_engine(engine, prompts, 128, "cuda")  # captures the bucket's K-step graph
        first = [run_engine(engine, prompts, 1, "cuda")[0] * 1000 for _ in range(7)]
        full = [run_engine(engine, prompts, 128, "cuda")[0] for _ in range(3)]
        results[batch] = _figures(first, batch * 128 / statistics.median(full))
        print(f"engine batch {batch}: {results[batch]}", flush=True)
        for tokens in (DECODE_TOKENS, 1):
            with torch.profiler.profile(activities=ACTIVITIES) as prof:
                run_engine(engine, prompts, tokens, "cuda")
            path = f"{tempfile.gettempdir()}/engine_b{batch}_{tokens}.json"
            prof.export_chrome_trace(path)
            kernel_table(path, f"engine batch {batch}, {tokens} token(s)", tokens)
    engine.scheduler.stop()
    return results


def sglang_part(model, batches) -> dict:
    import httpx

    from rl_sglang.client import EngineClient
    from rl_sglang.process import SGLangServer
    from rl_sglang.tiny import byte_tokenizer

    results, traces = {}, tempfile.mkdtemp()
    with tempfile.TemporaryDirectory() as weights:
        model.save_pretrained(weights)
        byte_tokenizer().save_pretrained(weights)
        args = SGLANG_BENCH_ARGS | {"dtype": "bfloat16"}
        env = {"SGLANG_TORCH_PROFILER_DIR": traces}
        with SGLangServer(weights, sglang_args=args, ready_timeout_s=600, env=env) as server:
            for batch in batches:
                prompts = make_prompts(batch, 128, model.config.vocab_size, batch)

                async def generate(tokens, prompts=prompts):
                    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
                    async with EngineClient(server.url) as client:
                        start = time.perf_counter()
                        await client.generate(input_ids=prompts, sampling_params=params)
                        return time.perf_counter() - start

                asyncio.run(generate(128))
                first = [asyncio.run(generate(1)) * 1000 for _ in range(7)]
                full = [asyncio.run(generate(128)) for _ in range(3)]
                results[batch] = _figures(first, batch * 128 / statistics.median(full))
                print(f"sglang batch {batch}: {results[batch]}", flush=True)
                out = f"{traces}/b{batch}"
                body = {"output_dir": out, "num_steps": DECODE_TOKENS, "activities": ["CPU", "GPU"]}
                httpx.post(server.url + "/start_profile", json=body, timeout=60)
                asyncio.run(generate(DECODE_TOKENS))
                time.sleep(3)  # the trace is written after the request's answer
                for path in glob.glob(f"{out}/**/*.json*", recursive=True)[:1]:
                    kernel_table(
                        path, f"sglang batch {batch}, {DECODE_TOKENS} tokens", DECODE_TOKENS
                    )
    return results


def _figures(first_ms: list[float], tokens_per_s: float) -> dict:
    return {
        "first_token_ms": [round(x, 2) for x in first_ms],
        "tokens_per_s": round(tokens_per_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--decode-attention", default="auto", choices=["auto", "triton", "sdpa"])
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = make_model("qwen2.5-0.5b", "cuda", torch.bfloat16)
    result = {"engine": engine_part(model, batches, args.decode_attention)}
    if os.environ.get("RL_SGLANG_PYTHONPATH"):
        result["sglang"] = sglang_part(model, batches)
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
