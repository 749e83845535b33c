"""FP8 rollout (``engine.quantization: fp8``) against bf16, each measured in the same run:
decode tokens/s at batch 64, the time of a weight sync, and the trainer/engine log-prob gap;
prints and writes one JSON object.

    # one H100/H200, real SGLang (RL_SGLANG_PYTHONPATH: SGLang's site dir), 1.5B shape:
    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') RL_SGLANG_PYTHONPATH=/tmp/sgsite
    python bench/fp8_rollout.py --out $OUT/fp8_rollout.json
    # CPU, the embedded engine, a real model (HF dir or .gguf): the log-prob gap only
    python bench/fp8_rollout.py --device cpu --model-path SmolLM2-135M-Instruct.Q4_1.gguf

GPU: a random-weight model of ``bench/model_shapes.py``'s shape is saved in bf16 and as the
FP8 checkpoint rl-train writes (``rl_sglang.fp8_checkpoint``); SGLang serves each in turn
(FP8 with ``--quantization fp8 --fp8-gemm-backend triton``: the bundle has no DeepGEMM, so
its triton block kernels do the matmuls). Per engine: greedy decode of ``--batch`` prompts
(``--prompt-len`` random ids, ``--new-tokens`` each, after a warm-up request); the gap on
16 sampled responses (temperature 1) against a teacher-forced HF forward in bf16 (the
trainer's dtype on GPU); a full weight sync of new trainer weights as a training rank makes
it (``EngineWeightSync``: kept send buffers, ``engine.weight_bucket_bytes`` buckets; FP8:
quantised on the GPU on the way), median of ``--repeats`` after a warm-up; then the gap
again against the new weights (the sync reached the engine).

CPU: the trainer is the model in float32 (rl-train's CPU dtype); engines in float32
(baseline), bfloat16, and FP8 dequantised to float32 and to bfloat16 (the embedded engine's
FP8) each sample ``--cpu-prompts`` responses of ``--cpu-new-tokens`` tokens at temperature 1.
"""

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from model_shapes import SHAPES
from report import write_report

from rl_core.fp8 import dequantize_named, quantize_named
from rl_core.weights import bucket_by_bytes
from rl_sglang.fp8_checkpoint import write_fp8_checkpoint

SGLANG_ARGS = {
    "dtype": "bfloat16",
    "mem_fraction_static": 0.5,
    "skip_tokenizer_init": True,
    "cuda_graph_max_bs_decode": 64,  # SGLang 0.5.15's name (--cuda-graph-max-bs is deprecated)
    # kernels every SGLang build has (the GPU machine's bundle leaves out FA3 and FlashInfer)
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "grammar_backend": "none",
}
FP8_ARGS = {"quantization": "fp8", "fp8_gemm_backend": "triton"}
GAP_PROMPTS, GAP_TOKENS = 16, 64
DEVICE = "cuda"  # the trainer's device in GPU mode
CPU_PROMPTS = [
    "Tom has 12 apples and eats 5. How many are left? Answer with the final number.",
    "A box holds 6 rows of 4 eggs. How many eggs are in the box?",
    "What is 37 + 48? Think step by step.",
    "Name three colours of the rainbow.",
]


def gap_stats(engine_lps: list[list[float]], trainer_lps: list[list[float]]) -> dict:
    pairs = zip(engine_lps, trainer_lps, strict=True)
    diffs = [abs(a - b) for e, t in pairs for a, b in zip(e, t, strict=True)]
    return {"mean": statistics.fmean(diffs), "max": max(diffs), "tokens": len(diffs)}


def teacher_forced(model, prompts, outputs, device) -> list[list[float]]:
    """Log-probs of each output after its prompt, one unbatched forward per sequence."""
    result = []
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([list(prompt) + list(output)], device=device)
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        lps = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt) :, None])
        result.append(lps[:, 0].tolist())
    return result


# ---- GPU: real SGLang --------------------------------------------------------------------
def trainer_model(shape: str, seed: int):
    """A random-weight bf16 model of ``shape``, made on the trainer's device (fast)."""
    from rl_sglang.tiny import random_model, tiny_config

    fields = {**SHAPES[shape], "max_position_embeddings": 4096}
    with torch.device(DEVICE):
        return random_model(tiny_config(**fields), seed=seed, dtype=torch.bfloat16)


def save_models(model, work: Path) -> tuple[Path, Path]:
    """``model`` saved in bf16 and as the FP8 checkpoint rl-train writes from it."""
    from rl_sglang.tiny import byte_tokenizer

    model.save_pretrained(work / "bf16")
    byte_tokenizer().save_pretrained(work / "bf16")
    return work / "bf16", write_fp8_checkpoint(work / "bf16", work / "fp8")


async def decode_tps(client, prompts, new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    await client.generate(input_ids=prompts[:1], sampling_params=params)  # warm-up
    start = time.perf_counter()
    await client.generate(input_ids=prompts, sampling_params=params)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


async def sampled(client, prompts) -> tuple[list, list]:
    params = {"max_new_tokens": GAP_TOKENS, "temperature": 1.0, "ignore_eos": True}
    outs = await client.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    lps = [[e[0] for e in o["meta_info"]["output_token_logprobs"]] for o in outs]
    return [o["output_ids"] for o in outs], lps


def synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def sync_seconds(url: str, named, quantization: str, repeats: int) -> list[float]:
    """Full syncs of ``named`` as a training rank makes them (rl-train's code path)."""
    from rl_launcher.infra.weight_sync import EngineWeightSync, quantized_buckets

    rank, times = EngineWeightSync(0), []
    how = {"transport": "tensor", "flatten": True, "buffer": "kept", "tp_size": 1}
    how |= {"senders": [0], "quantization": quantization}
    for rep in range(repeats + 1):
        synchronize()
        start = time.perf_counter()
        buckets = quantized_buckets(bucket_by_bytes(iter(named), bucket_bytes=1 << 30), how)
        rank.sync(buckets, [url], f"{quantization}-{rep}", how)
        times.append(time.perf_counter() - start)
    rank.release_buffers()
    return times[1:]


def unique_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The trainer's tensors, a tied lm_head once (as rl-fsdp exports them)."""
    seen, named = set(), []
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            named.append((name, tensor))
    return named


def measure_engine(kind: str, model_dir: Path, trainers: dict, args) -> dict:
    """One SGLang server: decode tokens/s, gap, sync time, gap after the sync."""
    from rl_sglang.client import EngineClient
    from rl_sglang.process import SGLangServer

    extra = FP8_ARGS if kind == "fp8" else {}
    gen = torch.Generator().manual_seed(0)
    vocab = trainers["old"].config.vocab_size
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=gen).tolist()
    started = time.perf_counter()
    with SGLangServer(model_dir, sglang_args=SGLANG_ARGS | extra, ready_timeout_s=600) as server:
        result = {"startup_s": time.perf_counter() - started}

        async def serve(fn, *more):
            async with EngineClient(server.url, timeout_s=600) as client:
                return await fn(client, *more)

        async def info(client):
            return await client.server_info()

        served = asyncio.run(serve(info))
        result["served"] = {k: served.get(k) for k in ("quantization", "fp8_gemm_runner_backend")}
        result["decode_tokens_per_s"] = asyncio.run(serve(decode_tps, prompts, args.new_tokens))
        gap_prompts = prompts[:GAP_PROMPTS]
        outputs, lps = asyncio.run(serve(sampled, gap_prompts))
        result["gap"] = gap_stats(
            lps, teacher_forced(trainers["old"], gap_prompts, outputs, DEVICE)
        )
        named = unique_tensors(trainers["new"])
        times = sync_seconds(server.url, named, "fp8" if kind == "fp8" else "none", args.repeats)
        sent = list(quantize_named(named)) if kind == "fp8" else named
        result["sync"] = {
            "median_s": statistics.median(times),
            "times_s": times,
            "gb_sent": sum(t.numel() * t.element_size() for _, t in sent) / 1e9,
        }
        outputs, lps = asyncio.run(serve(sampled, gap_prompts))
        after = teacher_forced(trainers["new"], gap_prompts, outputs, DEVICE)
        result["gap_after_sync"] = gap_stats(lps, after)
    print(json.dumps({kind: result}), flush=True)
    return result


def run_gpu(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="fp8_rollout-"))
    started = time.perf_counter()
    trainers = {"old": trainer_model(args.shape, 0), "new": trainer_model(args.shape, 1)}
    bf16_dir, fp8_dir = save_models(trainers["old"], work)
    report = {"shape": args.shape, "batch": args.batch, "new_tokens": args.new_tokens}
    report["models_saved_s"] = time.perf_counter() - started  # bf16 and FP8 checkpoints
    for kind, model_dir in (("bf16", bf16_dir), ("fp8", fp8_dir)):
        report[kind] = measure_engine(kind, model_dir, trainers, args)
    report["decode_speedup_fp8_over_bf16"] = (
        report["fp8"]["decode_tokens_per_s"] / report["bf16"]["decode_tokens_per_s"]
    )
    report["sync_time_ratio_fp8_over_bf16"] = (
        report["fp8"]["sync"]["median_s"] / report["bf16"]["sync"]["median_s"]
    )
    return report


# ---- CPU: the embedded engine on a real model --------------------------------------------
def load_cpu_model(path: str, work: Path) -> Path:
    """An HF directory of ``path`` (a .gguf file is dequantized into ``work`` first)."""
    if not path.endswith(".gguf"):
        return Path(path)
    from rl_launcher.session.model import load_gguf

    model, tokenizer = load_gguf(Path(path), dtype="float32")
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    return work / "model"


def engine_logprobs(model, tokenizer, prompts, new_tokens: int) -> tuple[list, list]:
    from rl_sglang.engine.core import Engine

    engine = Engine(model, tokenizer, max_batch_size=len(prompts), runner="dynamic")
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}

    async def go():
        groups, _ = engine.make_requests(
            {"input_ids": prompts, "sampling_params": params, "return_logprob": True}
        )
        return [o for g in groups for o in await engine.run(g)]

    outs = asyncio.run(go())
    lps = [[e[0] for e in o["meta_info"]["output_token_logprobs"]] for o in outs]
    return [o["output_ids"] for o in outs], lps


def run_cpu(args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="fp8_rollout-"))
    model_dir = load_cpu_model(args.model_path, work)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    messages = [[{"role": "user", "content": p}] for p in CPU_PROMPTS[: args.cpu_prompts]]
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in messages]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    exact = list(trainer.state_dict().items())
    fp8 = list(quantize_named(exact))
    report = {"model": args.model_path, "new_tokens": args.cpu_new_tokens, "gap": {}}
    engines = {
        "float32": exact,
        "bfloat16": exact,
        "fp8_dequantized_float32": fp8,
        "fp8_dequantized_bfloat16": fp8,
    }
    for name, named in engines.items():
        dtype = torch.bfloat16 if name.endswith("bfloat16") else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        model.load_state_dict(dict(dequantize_named(named, dtype)))
        torch.manual_seed(0)
        outputs, lps = engine_logprobs(model, tokenizer, prompts, args.cpu_new_tokens)
        report["gap"][name] = gap_stats(lps, teacher_forced(trainer, prompts, outputs, "cpu"))
        print(json.dumps({name: report["gap"][name]}), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-path", help="--device cpu: an HF directory or .gguf file")
    parser.add_argument("--cpu-prompts", type=int, default=4)
    parser.add_argument("--cpu-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.device == "cpu":
        if not args.model_path:
            parser.error("--device cpu needs --model-path (an HF directory or .gguf file)")
        report = run_cpu(args)
    else:
        if not torch.cuda.is_available():
            sys.exit("bench/fp8_rollout.py needs CUDA and SGLang; --device cpu for the gap alone")
        report = run_gpu(args)
        report["gpu"] = torch.cuda.get_device_name(0)
    report |= {
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        write_report(report, args.out)


if __name__ == "__main__":
    main()
