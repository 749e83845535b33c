"""Embedded engine vs plain ``model.generate``: greedy decoding tokens/s on the same prompts,
same model, same machine, at several batch sizes; prints one JSON object.

    python bench/engine.py                       # CPU: tiny Qwen2 (hidden 64, 2 layers)
    python bench/engine.py --shape qwen2.5-0.5b --device cuda --dtype bfloat16 \
        --prompt-len 128 --new-tokens 128        # GPU: Qwen2.5-0.5B shape, random weights
    ... --with-sglang                            # also real SGLang (if installed), same prompts

The engine is measured in-process (its scheduler, the code behind /generate) with every
request submitted at once; ``greedy_identical`` is the fraction of prompts whose greedy
output equals ``generate``'s token for token, in the benchmark's dtype and, separately, in
float32 (``greedy_float32``: random weights in bf16 give near-tied logits, so identity is
judged where rounding ties do not dominate). ``decode_step_ms`` is the GPU time of one
replay of the static runner's CUDA graph per batch bucket (the model's share of a step);
the rest of ``1000 * batch / engine_tokens_per_s`` per step is host work and prefill.
"""

import argparse
import asyncio
import json
import platform
import sys
import time

import torch
from model_shapes import SHAPES

from rl_sglang.engine.core import Engine
from rl_sglang.tiny import random_model, tiny_config

# the training benchmarks' 0.5b shape, plus what generation needs
QWEN25_05B = {
    **SHAPES["0.5b"],
    "max_position_embeddings": 32768,
    "eos_token_id": 151643,
    "pad_token_id": 151643,
}


def make_model(shape: str, device: str, dtype: torch.dtype):
    overrides = QWEN25_05B if shape == "qwen2.5-0.5b" else {}
    model = random_model(tiny_config(**overrides), seed=0, dtype=torch.float32)
    if shape == "qwen2.5-0.5b":  # keep activations in a sane range for a deep random net
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() > 1:
                    param.normal_(0.0, 0.02)
    return model.to(device=device, dtype=dtype).eval()


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 30000), (batch, length), generator=generator).tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_generate(model, prompts, new_tokens, device) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts, device=device)
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=model.config.pad_token_id,
        )
    sync(device)
    return time.perf_counter() - start, out[:, ids.shape[1] :].tolist()


def run_engine(engine: Engine, prompts, new_tokens, device) -> tuple[float, list[list[int]]]:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}

    async def go():
        groups, _ = engine.make_requests({"input_ids": prompts, "sampling_params": params})
        return await asyncio.gather(*(engine.run(g) for g in groups))

    sync(device)
    start = time.perf_counter()
    outs = asyncio.run(go())
    sync(device)
    return time.perf_counter() - start, [o[0]["output_ids"] for o in outs]


# kernels every SGLang build has (the GPU machine's bundle leaves out FA3 and FlashInfer)
SGLANG_BENCH_ARGS = {
    "skip_tokenizer_init": True,
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "grammar_backend": "none",
}


def run_sglang(model, prompts_by_batch, new_tokens, args) -> dict:
    """Real SGLang on the same weights (saved to a temp dir), through its HTTP API."""
    import tempfile

    from rl_sglang.client import EngineClient
    from rl_sglang.process import SGLangServer
    from rl_sglang.tiny import byte_tokenizer

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        byte_tokenizer().save_pretrained(tmp)
        server = SGLangServer(tmp, sglang_args=SGLANG_BENCH_ARGS | {"dtype": args.dtype},
                              ready_timeout_s=600)  # fmt: skip
        with server:
            for batch, prompts in prompts_by_batch.items():
                params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}

                async def go(prompts=prompts, params=params):
                    async with EngineClient(server.url) as client:
                        await client.generate(input_ids=prompts[:1], sampling_params=params)
                        start = time.perf_counter()
                        await client.generate(input_ids=prompts, sampling_params=params)
                        return time.perf_counter() - start

                results[batch] = batch * new_tokens / asyncio.run(go())
    return results


def greedy_agreement(args, batch: int = 8, new_tokens: int = 32) -> dict:
    """Fraction of prompts whose greedy engine output equals ``generate``'s, in float32."""
    model = make_model(args.shape, args.device, torch.float32)
    engine = Engine(model, None, max_batch_size=batch, runner=args.runner,
                    max_context=args.prompt_len + new_tokens + 8, compile=args.compile)  # fmt: skip
    prompts = make_prompts(batch, args.prompt_len, model.config.vocab_size, seed=7)
    try:
        _, generate_out = run_generate(model, prompts, new_tokens, args.device)
        _, engine_out = run_engine(engine, prompts, new_tokens, args.device)
    finally:
        engine.scheduler.stop()
    same = [a == b for a, b in zip(engine_out, generate_out, strict=True)]
    first_diff = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), new_tokens)
        for a, b in zip(engine_out, generate_out, strict=True)
    ]
    return {"batch": batch, "new_tokens": new_tokens, "identical": sum(same) / batch,
            "mean_first_divergence": sum(first_diff) / batch}  # fmt: skip


def decode_step_ms(engine: Engine, batches: list[int], repeats: int = 20) -> dict:
    """GPU milliseconds of one CUDA-graph replay per batch bucket (engine idle)."""
    graphs = getattr(engine.scheduler.runner, "graphs", None)
    if graphs is None:
        return {}
    timings = {}
    for batch in batches:
        bucket = next(b for b in graphs.buckets if b >= batch)
        graph = graphs.graphs[bucket][0]
        for _ in range(3):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        timings[batch] = round(start.elapsed_time(end) / repeats, 3)
    return timings


def hardware(device: str) -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    info |= {"torch": torch.__version__, "python": platform.python_version()}
    import transformers

    info["transformers"] = transformers.__version__
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny", choices=["tiny", "qwen2.5-0.5b"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runner", default="auto", choices=["auto", "dynamic", "static"])
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    parser.add_argument("--with-sglang", action="store_true")
    parser.add_argument("--skip-float32-check", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model = make_model(args.shape, args.device, dtype)
    batches = [int(b) for b in args.batches.split(",")]
    max_context = args.prompt_len + args.new_tokens + 8
    start = time.perf_counter()
    engine = Engine(model, None, max_batch_size=max(batches), runner=args.runner,
                    max_context=max_context, compile=args.compile)  # fmt: skip
    startup_s = time.perf_counter() - start
    warm = make_prompts(2, args.prompt_len, model.config.vocab_size, seed=99)
    run_generate(model, warm, 4, args.device)
    run_engine(engine, warm, 4, args.device)
    rows, prompts_by_batch = [], {}
    for batch in batches:
        prompts = prompts_by_batch[batch] = make_prompts(
            batch, args.prompt_len, model.config.vocab_size, batch
        )
        generate_s, generate_out = run_generate(model, prompts, args.new_tokens, args.device)
        engine_s, engine_out = run_engine(engine, prompts, args.new_tokens, args.device)
        tokens = batch * args.new_tokens
        same = sum(a == b for a, b in zip(engine_out, generate_out, strict=True)) / batch
        rows.append({
            "batch": batch,
            "engine_tokens_per_s": round(tokens / engine_s, 1),
            "generate_tokens_per_s": round(tokens / generate_s, 1),
            "ratio": round(generate_s / engine_s, 3),
            "greedy_identical": same,
        })  # fmt: skip
    step_ms = decode_step_ms(engine, batches) if args.device.startswith("cuda") else {}
    compiled = bool(getattr(engine.scheduler.runner, "compiled", False))
    engine.scheduler.stop()
    result = {
        "benchmark": "embedded engine vs model.generate (greedy tokens/s)",
        "shape": args.shape,
        "runner": engine.runner_kind,
        "compiled": compiled,
        "engine_startup_s": round(startup_s, 1),
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "results": rows,
        "decode_step_ms": step_ms,
        "hardware": hardware(args.device),
        "command": " ".join([sys.executable.split("/")[-1], *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if args.with_sglang:
        result["sglang_tokens_per_s"] = run_sglang(model, prompts_by_batch, args.new_tokens, args)
    if not args.skip_float32_check:
        del engine
        try:  # a failure here must not lose the throughput figures above
            result["greedy_float32"] = greedy_agreement(args)
        except (RuntimeError, ValueError) as error:
            result["greedy_float32"] = {"error": repr(error)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
