"""FP8 rollout (``engine.quantization: fp8``) against bf16, each measured in the same run:
decode tokens/s at batch 64, the time of a weight sync, and the trainer/engine log-prob gap;
prints and writes one JSON object.

    # one H100/H200, real SGLang (RL_SGLANG_PYTHONPATH: SGLang's site dir), 1.5B shape:
    export PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') RL_SGLANG_PYTHONPATH=/tmp/sgsite
    python bench/fp8_rollout.py --out $OUT/fp8_rollout.json
    # CPU, the embedded engine, a real model (HF dir or .gguf): the log-prob gap only
    python bench/fp8_rollout.py --device cpu --model-path SmolLM2-135M-Instruct.Q4_1.gguf

The random model (GPU, and CPU without ``--model-path``): ``bench/model_shapes.py``'s shape
with its matrices drawn from N(0, 0.02) (the config's ``initializer_range``), those writing
into the residual stream (``o_proj``, ``down_proj``) from N(0, 0.02 / sqrt(2 x layers)) as in
Megatron's scaled init, and the final norm's weight set to 5 (logits with a spread of ~4).
The N(0, 0.2) init used before made attention and logits so sharp that any rounding moved
log-probs by nats: on CPU, 1.5B shape, its FP8 round trip alone gave 11.6 nats a token and
SGLang's FP8 arithmetic 7.5 against the original weights, as SGLang's FP8 gave on the GPU
(15.9; bf16 against bf16 1.07), which hid whether FP8 computed the right thing. On this
model (CPU, 1.5B shape, 4 x 16 sampled tokens): bf16 against float32 0.09, the FP8 round
trip of the weights 0.78, SGLang's FP8 arithmetic 0.91-1.0 (0.57-0.64 of it against the
round trip: the activation rounding). A deep random network has no margins, so FP8 still
moves it by about a nat: expect SGLang's FP8 gap near these figures on the GPU.

GPU: the random model is saved in bf16 and as the FP8 checkpoint rl-train writes
(``rl_sglang.fp8_checkpoint``); SGLang serves each in turn (FP8 with ``--quantization fp8
--fp8-gemm-backend triton``: the bundle has no DeepGEMM, so its triton block kernels do the
matmuls). Per engine: greedy decode of ``--batch`` prompts (``--prompt-len`` random ids,
``--new-tokens`` each, after a warm-up request); the gap on 16 sampled responses
(temperature 1) against a teacher-forced HF forward in bf16 (the trainer's dtype on GPU),
and for FP8 also against the trainer's weights after an FP8 round trip (quantised and
dequantised: what the engine should compute; what is left is SGLang's activation rounding
and kernels); a full weight sync of new trainer weights as a training rank makes it
(``EngineWeightSync``: kept send buffers, ``engine.weight_bucket_bytes`` buckets; FP8:
quantised on the GPU on the way), median of ``--repeats`` after a warm-up; then the gaps
again against the new weights (the sync reached the engine).

CPU, ``--model-path``: the trainer is the model in float32 (rl-train's CPU dtype); engines in
float32 (baseline), bfloat16, and FP8 dequantised to float32 and to bfloat16 (the embedded
engine's FP8) each sample ``--cpu-prompts`` responses of ``--cpu-new-tokens`` tokens at
temperature 1.

CPU, no ``--model-path``: the gap the GPU run should show, simulated on the random model of
``--shape`` (``--layers``: fewer decoder layers). The trainer is the model in float32; on the
same sampled tokens (``--cpu-prompts`` random prompts of ``--prompt-len`` ids, sampled by the
simulated FP8 engine) it scores the same weights in bf16 (the bf16 engine's floor), the FP8
round trip of the weights, and SGLang's FP8 arithmetic: round-trip weights and activations
quantised per token in groups of 128 (``per_token_group_quant_fp8``), in float32 and bf16.

    python bench/fp8_rollout.py --device cpu --shape 1.5b --prompt-len 32 --cpu-new-tokens 16
"""

import argparse
import asyncio
import contextlib
import copy
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from model_shapes import SHAPES
from report import write_report

from rl_core.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_block_fp8,
    dequantize_named,
    is_quantized_weight,
    quantize_block_fp8,
    quantize_named,
)
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
INIT_STD = 0.02  # every matrix of the random model (the config's initializer_range)
# the layers that write into the residual stream: N(0, INIT_STD / sqrt(2 * layers)), as
# Megatron's scaled init has them, so that rounding anywhere is not amplified by depth
RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight")
FINAL_NORM_SCALE = 5.0  # the final norm's weight: logits with a spread of ~4 (module text)
ACTIVATION_GROUP = 128  # SGLang's FP8 block kernels quantise activations per 1 x 128 group
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


def trainer_model(shape: str, seed: int, device: str = DEVICE, layers: int | None = None):
    """The random bf16 model of ``shape`` (module text), made on ``device``; ``layers``:
    fewer decoder layers (a CPU simulation)."""
    from transformers import AutoModelForCausalLM

    from rl_sglang.tiny import tiny_config

    fields = {**SHAPES[shape], "max_position_embeddings": 4096}
    if layers:
        fields["num_hidden_layers"] = layers
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(tiny_config(**fields), dtype=torch.bfloat16)
    output_std = INIT_STD / math.sqrt(2 * fields["num_hidden_layers"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                scaled = name.endswith(RESIDUAL_OUTPUTS)
                param.normal_(0.0, output_std if scaled else INIT_STD)
        model.model.norm.weight.fill_(FINAL_NORM_SCALE)
    return model.eval()


def quantized_params(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The weights an FP8 engine quantises."""
    return [(n, p) for n, p in model.named_parameters() if is_quantized_weight(n, p.shape)]


def round_trip_fp8(model) -> None:
    """Each weight an FP8 engine quantises replaced, in place, by its dequantised FP8 form."""
    with torch.no_grad():
        for _, param in quantized_params(model):
            quantized, scale = quantize_block_fp8(param)
            param.copy_(dequantize_block_fp8(quantized, scale, param.dtype))


def fp8_twin(model):
    """A copy of ``model`` with the weights an FP8 engine computes with."""
    twin = copy.deepcopy(model)
    round_trip_fp8(twin)
    return twin


# ---- GPU: real SGLang --------------------------------------------------------------------


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


def engine_gaps(kind: str, lps, trainers: dict, which: str, prompts, outputs) -> dict:
    """The gap against the trainer's weights, and for FP8 also against their FP8 round trip
    (``trainers["<which>_fp8"]``: what the engine should compute)."""
    gaps = {"gap": gap_stats(lps, teacher_forced(trainers[which], prompts, outputs, DEVICE))}
    if kind == "fp8":
        twin = trainers[f"{which}_fp8"]
        gaps["gap_vs_fp8_round_trip"] = gap_stats(
            lps, teacher_forced(twin, prompts, outputs, DEVICE)
        )
    return gaps


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
        result |= engine_gaps(kind, lps, trainers, "old", gap_prompts, outputs)
        named = unique_tensors(trainers["new"])
        times = sync_seconds(server.url, named, "fp8" if kind == "fp8" else "none", args.repeats)
        sent = list(quantize_named(named)) if kind == "fp8" else named
        result["sync"] = {
            "median_s": statistics.median(times),
            "times_s": times,
            "gb_sent": sum(t.numel() * t.element_size() for _, t in sent) / 1e9,
        }
        outputs, lps = asyncio.run(serve(sampled, gap_prompts))
        after = engine_gaps(kind, lps, trainers, "new", gap_prompts, outputs)
        result |= {f"{key}_after_sync": value for key, value in after.items()}
    print(json.dumps({kind: result}), flush=True)
    return result


def run_gpu(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="fp8_rollout-"))
    started = time.perf_counter()
    trainers = {"old": trainer_model(args.shape, 0), "new": trainer_model(args.shape, 1)}
    trainers |= {f"{name}_fp8": fp8_twin(model) for name, model in list(trainers.items())}
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


# ---- CPU: the random model's expected gap -------------------------------------------------
def quantize_activation_groups(x: torch.Tensor) -> torch.Tensor:
    """``x`` after SGLang's dynamic FP8 activation quantisation: e4m3 with one scale per
    token and group of 128 input features (amax / 448), dequantised. A last partial group
    is padded with zeros (no effect on its amax)."""
    features = x.shape[-1]
    padded = torch.nn.functional.pad(x.float(), (0, -features % ACTIVATION_GROUP))
    groups = padded.unflatten(-1, (-1, ACTIVATION_GROUP))
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    quantized = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale
    return quantized.flatten(-2)[..., :features].to(x.dtype)


@contextlib.contextmanager
def fp8_activations(model):
    """Within: the inputs of every FP8 linear layer quantised as SGLang's kernels do."""
    hooks = [
        module.register_forward_pre_hook(lambda _, args: (quantize_activation_groups(args[0]),))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and is_quantized_weight(f"{name}.weight", module.weight.shape)
    ]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def run_cpu_random(args) -> dict:
    """The gaps an engine should show on the random model of the GPU run (module text)."""
    model = trainer_model(args.shape, 0, "cpu", args.layers).float()
    exact = {n: p.detach().to(torch.bfloat16) for n, p in quantized_params(model)}  # lossless
    gen = torch.Generator().manual_seed(0)
    shape = (args.cpu_prompts, args.prompt_len)
    prompts = torch.randint(0, model.config.vocab_size, shape, generator=gen).tolist()
    round_trip_fp8(model)
    with fp8_activations(model):
        outputs = sample_outputs(model, prompts, args.cpu_new_tokens)
    scored = {}
    with fp8_activations(model):
        scored["fp8_float32"] = teacher_forced(model, prompts, outputs, "cpu")
    scored["fp8_weights_float32"] = teacher_forced(model, prompts, outputs, "cpu")
    with fp8_activations(model.to(torch.bfloat16)):
        scored["fp8_bfloat16"] = teacher_forced(model, prompts, outputs, "cpu")
    with torch.no_grad():  # back to the trainer's weights, in bf16
        for name, param in quantized_params(model):
            param.copy_(exact[name])
    scored["bfloat16"] = teacher_forced(model, prompts, outputs, "cpu")
    trainer = teacher_forced(model.float(), prompts, outputs, "cpu")
    round_trip = scored["fp8_weights_float32"]
    gaps = {name: gap_stats(lps, trainer) for name, lps in scored.items()}
    gaps["fp8_float32_vs_fp8_round_trip"] = gap_stats(scored["fp8_float32"], round_trip)
    gaps["fp8_bfloat16_vs_fp8_round_trip"] = gap_stats(scored["fp8_bfloat16"], round_trip)
    layers = model.config.num_hidden_layers
    return {"shape": args.shape, "layers": layers, "prompt_len": args.prompt_len, "gap": gaps}


def sample_outputs(model, prompts, new_tokens: int) -> list[list[int]]:
    """``new_tokens`` ids per prompt sampled at temperature 1 (HF ``generate``, seeded)."""
    torch.manual_seed(1)
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-path", help="--device cpu: an HF directory or .gguf file")
    parser.add_argument("--layers", type=int, help="--device cpu, random model: fewer layers")
    parser.add_argument("--cpu-prompts", type=int, default=4)
    parser.add_argument("--cpu-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.device == "cpu":
        report = run_cpu(args) if args.model_path else run_cpu_random(args)
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
