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
decode step of the static runner's CUDA graphs per batch bucket (the model's share of a
step; ``multi``: the K-step graph's replay / K); ``engine_first_token_ms`` times a 1-token
request (prefill and fixed overheads) and ``engine_ms_per_step`` the rest per decode step.
``engine_startup_s`` is the engine's start (compile and graph captures included).
"""

import argparse
import asyncio
import json
import platform
import sys
import time

import torch
from model_shapes import SHAPES
from report import write_report

from rl_sglang.engine.core import DEFAULT_MULTI_STEP, Engine
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
    """One batch body, admitted at once (as the server does), like SGLang's measurement."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}

    async def go():
        groups, _ = engine.make_requests({"input_ids": prompts, "sampling_params": params})
        return await engine.run([r for group in groups for r in group])

    sync(device)
    start = time.perf_counter()
    outs = asyncio.run(go())
    sync(device)
    return time.perf_counter() - start, [o["output_ids"] for o in outs]


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
        server = SGLangServer(
            tmp, sglang_args=SGLANG_BENCH_ARGS | {"dtype": args.dtype}, ready_timeout_s=600
        )
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


def _attention_used(engine) -> str | None:
    """The static runner's decode attention ("triton" or "sdpa"); None for the dynamic one."""
    fused = getattr(engine.scheduler.runner, "fused_attention", None)
    return None if fused is None else "triton" if fused else "sdpa"


def greedy_agreement(args, batch: int = 8, new_tokens: int = 32) -> dict:
    """Fraction of prompts whose greedy engine output equals ``generate``'s, in float32
    (CUDA graphs of the eager layer: a second compile would cost minutes of the run)."""
    model = make_model(args.shape, args.device, torch.float32)
    engine = Engine(
        model,
        None,
        max_batch_size=batch,
        runner=args.runner,
        max_context=args.prompt_len + new_tokens + 8,
        compile=False,
        decode_attention=args.decode_attention,
    )
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
    return {
        "batch": batch,
        "new_tokens": new_tokens,
        "identical": sum(same) / batch,
        "mean_first_divergence": sum(first_diff) / batch,
        "compiled": False,
    }


def multi_step_agreement(engine: Engine, prompts, args) -> float | None:
    """Fraction of prompts whose greedy output with multi-step rounds equals the output
    with one step per round (same engine, same dtype: it must be 1.0, bit for bit)."""
    runner = engine.scheduler.runner
    steps = getattr(runner, "multi_step", 1)
    if steps == 1:
        return None
    _, multi_out = run_engine(engine, prompts, args.new_tokens, args.device)
    runner.multi_step = 1  # the scheduler reads it per round
    try:
        _, single_out = run_engine(engine, prompts, args.new_tokens, args.device)
    finally:
        runner.multi_step = steps
    return sum(a == b for a, b in zip(multi_out, single_out, strict=True)) / len(prompts)


def decode_step_ms(engine: Engine, batches: list[int], repeats: int = 20) -> dict:
    """GPU milliseconds per decode step of the CUDA graphs per batch bucket (engine idle):
    ``single`` one step's graph, ``multi`` the K-step graph's replay divided by K."""
    graphs = getattr(engine.scheduler.runner, "graphs", None)
    if graphs is None:
        return {}
    timings: dict = {"single": {}, "multi": {}}
    for batch in batches:
        bucket = next(b for b in graphs.buckets if b >= batch)
        timings["single"][batch] = replay_ms(graphs.graphs[bucket][0], repeats)
        if graphs.multi:
            per_round = replay_ms(graphs.multi[bucket][0], max(1, repeats // graphs.multi_step))
            timings["multi"][batch] = round(per_round / graphs.multi_step, 3)
    return timings


def replay_ms(graph, repeats: int) -> float:
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / repeats, 3)


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
    parser.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="the engine's KV slot size (default: prompt + new tokens + 8); a larger one "
        "shows what each decode step pays for room a row does not use",
    )
    parser.add_argument("--runner", default="auto", choices=["auto", "dynamic", "static"])
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the decode step (default: the engine's, on with CUDA)",
    )
    parser.add_argument(
        "--multi-step",
        type=int,
        default=DEFAULT_MULTI_STEP,
        help="greedy decode steps per round (1 = one step per round)",
    )
    parser.add_argument(
        "--decode-attention",
        default="auto",
        choices=["auto", "triton", "sdpa"],
        help="the static runner's decode attention (auto: Triton kernels on CUDA)",
    )
    parser.add_argument("--with-sglang", action="store_true")
    parser.add_argument("--out", help="also write the JSON here, after each phase")
    parser.add_argument("--skip-float32-check", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model = make_model(args.shape, args.device, dtype)
    batches = [int(b) for b in args.batches.split(",")]
    max_context = args.max_context or args.prompt_len + args.new_tokens + 8
    start = time.perf_counter()
    engine = Engine(
        model,
        None,
        max_batch_size=max(batches),
        runner=args.runner,
        max_context=max_context,
        compile=args.compile,
        multi_step=args.multi_step,
        decode_attention=args.decode_attention,
    )
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
        # a bucket's K-step greedy graph is captured at its first greedy decode: not timed
        run_engine(engine, prompts, args.new_tokens, args.device)
        engine_s, engine_out = run_engine(engine, prompts, args.new_tokens, args.device)
        first_token_s, _ = run_engine(engine, prompts, 1, args.device)  # prefill + overheads
        tokens, steps = batch * args.new_tokens, max(1, args.new_tokens - 1)
        same = sum(a == b for a, b in zip(engine_out, generate_out, strict=True)) / batch
        rows.append(
            {
                "batch": batch,
                "engine_tokens_per_s": round(tokens / engine_s, 1),
                "generate_tokens_per_s": round(tokens / generate_s, 1),
                "ratio": round(generate_s / engine_s, 3),
                "engine_first_token_ms": round(1000 * first_token_s, 1),
                "engine_ms_per_step": round(1000 * (engine_s - first_token_s) / steps, 3),
                "greedy_identical": same,
            }
        )
    step_ms = decode_step_ms(engine, batches) if args.device.startswith("cuda") else {}
    multi_same = multi_step_agreement(engine, prompts_by_batch[batches[-1]], args)
    compiled = bool(getattr(engine.scheduler.runner, "compiled", False))
    engine.scheduler.stop()
    result = {
        "benchmark": "embedded engine vs model.generate (greedy tokens/s)",
        "shape": args.shape,
        "runner": engine.runner_kind,
        "compiled": compiled,
        "multi_step": getattr(engine.scheduler.runner, "multi_step", 1),
        "decode_attention": _attention_used(engine),
        "prefill": "fused layers into slots" if engine.runner_kind == "static" else "HF forward",
        "engine_startup_s": round(startup_s, 1),
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "max_context": max_context,
        "results": rows,
        "decode_step_ms": step_ms,
        "multi_step_identical": multi_same,
        "hardware": hardware(args.device),
        "command": " ".join([sys.executable.split("/")[-1], *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    write(result, args.out)  # each phase's figures survive a later failure or timeout
    if args.with_sglang:
        try:
            sglang = run_sglang(model, prompts_by_batch, args.new_tokens, args)
        except Exception as error:  # reported in the JSON; the engine figures are kept
            sglang = {"error": repr(error)}
        result["sglang_tokens_per_s"] = sglang
        result["engine_over_sglang"] = {
            row["batch"]: round(row["engine_tokens_per_s"] / sglang[row["batch"]], 3)
            for row in rows
            if row["batch"] in sglang
        }
        write(result, args.out)
    if not args.skip_float32_check:
        del engine
        try:  # a failure here must not lose the throughput figures above
            result["greedy_float32"] = greedy_agreement(args)
        except (RuntimeError, ValueError) as error:
            result["greedy_float32"] = {"error": repr(error)}
    write(result, args.out)
    print(json.dumps(result, indent=1))


def write(result: dict, path: str | None) -> None:
    if path:
        write_report(result, path, indent=1)


if __name__ == "__main__":
    main()
