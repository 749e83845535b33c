"""Training-step throughput of the rl-fsdp backend against a plain Hugging Face loop.

One optimizer step (forward + backward + AdamW) over the same batch of sequences, both
measured in this run: rl-fsdp (FSDP2, packed micro-batches of --max-tokens, the RL loss
through rl_core) vs a plain HF loop (padded rows, no packing, SDPA, HF's cross-entropy,
activation checkpointing, fused AdamW; rl-fsdp checkpoints only with --checkpointing).
MFU (model FLOPs, recomputation not counted) is relative to the bf16 matmul rate measured
here. rl-fsdp runs first (its warm-up step includes compiling FlexAttention / the layers),
then the plain loop (fewer measured steps: it is the slower one). Progress goes to stderr;
prints one JSON object, whose ``figure.levers`` says which GPU-step levers ran (compiled
decoder layers or MLPs / norms, single-rank FSDP settings; each has a flag turning it
off: --no-compile-blocks, --no-compile-attention, --reshard-after-forward,
--reshard-after-backward, --reduce-fp32, --fsdp-on-one-rank)
and ``figure.fallback_errors`` what failed and was measured the simpler way. With
--profile, one more rl-fsdp step runs under torch.profiler (after the timed ones, so it
costs nothing otherwise): ``figure.profile`` has the step's device-busy fraction, the top
kernels and their time by category (rl_fsdp.profiling), then one step counts where the host
waited for the device (``figure.profile.syncs``, by source line) and one attributes the
copy, memset and NCCL device time to the operators and call sites that launched it
(``figure.profile.copies``). --sync-debug alone runs only the sync count (``figure.syncs``).
With --host-profile, one more step runs under cProfile (``figure.host_profile``: the
functions taking the host's time). --baseline-steps 0 skips the plain loop (A/B runs of
rl-fsdp only).
``figure.compile`` counts what torch.compile did over the whole run: graph breaks (and why),
graphs, frames compiled (recompiles included). --device cpu --compile-blocks runs the
compiled GPU path's structure on CPU (inductor's C++ kernels): breaks and recompiles show
there too.

    python bench/train_fsdp.py                                  # CPU, tiny shape
    python bench/train_fsdp.py --shape 1.5b --data full         # GPU: 4 x 2048 tokens
    python bench/train_fsdp.py --shape 1.5b --data varlen       # GPU: lengths 128..4096
    python bench/train_fsdp.py --shape 1.5b --data varlen --profile   # + where time goes
    python bench/train_fsdp.py --device cpu --compile-blocks --baseline-steps 0   # CPU, compiled

--data loop runs --steps RL-loop steps instead, each on a new batch shaped like the loop's
(--num-seqs samples of a --prompt-len prompt and a response of 1..--max-len tokens whose
mean drifts between steps, a twentieth truncated; bench/train_batches.loop_lengths): a
no-grad log-probs pass over the batch, then --minibatches optimizer steps over its
round-robin minibatches, in micro-batches of --max-tokens. ``figure.loop`` has each
step's seconds, minibatch token counts, frames compiled and recompile reasons (dynamo's
"recompiles" log), and ``recompiles_after_first_step``: 0 when the compiled layers
compiled once. --unbacked-tokens, --backed-tokens and --strict-mix-order switch
rl_fsdp.fusion's choices for A/B runs in one call; --profile adds one more loop step under
torch.profiler (``figure.profile``).

    python bench/train_fsdp.py --shape 0.5b --data loop --steps 10 --baseline-steps 0 --profile
    python bench/train_fsdp.py --shape 0.5b --data loop --steps 10 --baseline-steps 0 --profile --unbacked-tokens
    python bench/train_fsdp.py --device cpu --compile-blocks --attention sdpa_mask --data loop
"""

import argparse
import gc
import itertools
import json
import logging
import platform
import sys
import time
from datetime import UTC, datetime

import torch
from model_shapes import SHAPES
from torch.nn.utils.rnn import pad_sequence
from train_batches import lengths_for, loop_lengths, make_batch, round_robin_minibatches

from rl_core.batch import TrainBatch
from rl_core.compiling import compile_report
from rl_fsdp import FSDPBackend, FSDPConfig, fusion, modeling
from rl_fsdp.metrics import train_flops
from rl_fsdp.modeling import enable_activation_checkpointing
from rl_fsdp.torch_varlen import PROBE_ERRORS


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: cuda when available, except for the tiny shape",
    )
    parser.add_argument("--data", choices=["full", "varlen", "loop"], default="varlen")
    parser.add_argument("--num-seqs", type=int, default=None, help="sequences per step")
    parser.add_argument("--max-len", type=int, default=None, help="longest sequence")
    parser.add_argument("--max-tokens", type=int, default=None, help="packed micro-batch budget")
    parser.add_argument("--steps", type=int, default=2, help="measured steps (after 1 warm-up)")
    parser.add_argument("--prompt-len", type=int, default=4, help="--data loop: prompt tokens")
    parser.add_argument("--minibatches", type=int, default=4, help="--data loop: per step")
    parser.add_argument(
        "--backed-tokens",
        action="store_true",
        help="the token dimension backed everywhere (the default: on CUDA) (A/B)",
    )
    parser.add_argument(
        "--unbacked-tokens",
        action="store_true",
        help="the token dimension unbacked everywhere (the default: on the CPU) (A/B)",
    )
    parser.add_argument(
        "--strict-mix-order",
        action="store_true",
        help="Triton's mix-order reduction checks sizes, as before the fix (A/B)",
    )
    parser.add_argument("--baseline-steps", type=int, default=1, help="measured plain steps")
    parser.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing in rl-fsdp too"
    )
    parser.add_argument(
        "--baseline-no-checkpointing", action="store_true", help="plain loop without it"
    )
    parser.add_argument("--attention", default="auto")
    parser.add_argument(
        "--compile-layers", action="store_true", help="torch.compile each rl-fsdp layer"
    )
    # The levers on by default on one GPU (rl_fsdp.fusion, rl_fsdp.modeling); each flag
    # turns one off, so one run per flag shows its effect.
    parser.add_argument(
        "--no-compile-blocks", action="store_true", help="eager MLPs and norms (no fusion)"
    )
    parser.add_argument(
        "--compile-blocks",
        action="store_true",
        help="compiled layers / blocks where they are off by default (CPU)",
    )
    parser.add_argument(
        "--no-compile-attention",
        action="store_true",
        help="compile MLPs and norms only, not whole layers (attention modules eager)",
    )
    parser.add_argument(
        "--reshard-after-forward", action="store_true", help="ZeRO-3 resharding on one rank"
    )
    parser.add_argument(
        "--reshard-after-backward",
        action="store_true",
        help="free the layers after every micro-batch (one rank: gather once per step)",
    )
    parser.add_argument("--reduce-fp32", action="store_true", help="fp32 grads reduce on one rank")
    parser.add_argument(
        "--fsdp-on-one-rank",
        action="store_true",
        help="FSDP2 on one GPU too (default there: float32 masters + bf16 copy, no FSDP)",
    )
    parser.add_argument(
        "--sync-debug",
        action="store_true",
        help="one more rl-fsdp step under CUDA's sync debug mode: where the host waited",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile one more rl-fsdp step: busy fraction, top kernels, categories",
    )
    parser.add_argument(
        "--host-threads",
        type=int,
        default=None,
        help="torch.set_num_threads(N) before the run (GPU: the host's small tensor ops)",
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="one more rl-fsdp step under cProfile: where the host's time goes",
    )
    return parser.parse_args(argv)


def matmul_tflops(device: torch.device) -> float:
    """Measured dense matmul rate (bf16 on GPU, fp32 on CPU), TFLOP/s."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    iters = 20 if device.type == "cuda" else 5
    start = _now(device)
    for _ in range(iters):
        a @ b
    return 2 * n**3 * iters / (_now(device) - start) / 1e12


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def plain_hf_loop(args, model_config: dict, batch: TrainBatch, device) -> float:
    """Seconds per step of the plain padded loop (model freed afterwards)."""
    step = _plain_hf_step(args, model_config, batch, device)
    _log("baseline built")
    seconds = _timed(step, args.baseline_steps, device, "baseline")
    del step
    _free(device)
    return seconds


def _free(device) -> None:
    torch._dynamo.reset()  # compiled graphs keep the freed model's modules alive
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


_START = time.perf_counter()


def _log(message: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f} s] {message}", file=sys.stderr, flush=True)


def _plain_hf_step(args, model_config: dict, batch: TrainBatch, device):
    """One step of the plain loop; rows grouped in order, as many per micro-batch as fit
    ``max_tokens`` at the longest length, padded to the micro-batch's longest row."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(model_config)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):  # random init on the GPU: seconds, not a minute
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    if not args.baseline_no_checkpointing:
        enable_activation_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    bounds = batch.cu_seqlens.tolist()
    rows = [batch.tokens[a:b] for a, b in itertools.pairwise(bounds)]
    per_micro = max(1, args.max_tokens // args.max_len)
    micro = [rows[i : i + per_micro] for i in range(0, len(rows), per_micro)]

    def step():
        optimizer.zero_grad(set_to_none=True)
        for group in micro:
            ids = pad_sequence(group, batch_first=True).to(device)
            ones = [torch.ones_like(r) for r in group]
            attn = pad_sequence(ones, batch_first=True).to(device)
            labels = ids.masked_fill(attn == 0, -100)
            loss = model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False).loss
            (loss * len(group) / len(rows)).backward()
        optimizer.step()

    return step


def fsdp_step(args, model_config: dict, batch: TrainBatch, device) -> tuple[float, FSDPBackend]:
    """Seconds per rl-fsdp step. On a GPU, a failure is recorded in ``FALLBACK_ERRORS``
    and the step measured again: without --compile-layers, then without the compiled
    attention modules, then without any compiled blocks, then with sdpa_per_doc; a failure
    naming the varlen kernel is measured again with sdpa_grouped first."""
    fallbacks = [
        ("compile_layers", False),
        ("no_compile_attention", True),
        ("no_compile_blocks", True),
        ("attention", "sdpa_per_doc"),
    ]
    while True:
        try:
            return _fsdp_step(args, model_config, batch, device)
        except Exception as err:  # recorded in the JSON, then measured the simpler way
            fallbacks = [(k, v) for k, v in fallbacks if getattr(args, k) != v]
            if device.type != "cuda" or not fallbacks:
                raise
            what = f"{args.compile_layers=} {args.no_compile_blocks=} "
            what += f"{args.no_compile_attention=} {args.attention=}"
            FALLBACK_ERRORS.append(f"{what}: {err!r}"[:400])
            if "varlen" in repr(err).lower() and args.attention != "sdpa_grouped":
                fallbacks.insert(0, ("attention", "sdpa_grouped"))  # the kernel failed
        name, value = fallbacks.pop(0)
        _log(f"failed ({FALLBACK_ERRORS[-1]}); measuring again with {name}={value}")
        setattr(args, name, value)
        _free(device)


FALLBACK_ERRORS: list[str] = []


def _fsdp_step(args, model_config: dict, batch: TrainBatch, device):
    backend = FSDPBackend(_fsdp_config(args, model_config, device))
    _log(f"rl-fsdp built (attention {backend.attention}, levers {levers(backend)})")
    step_s = _timed(lambda: backend.train_step(batch), args.steps, device, "figure")
    if args.profile:
        _profile(lambda: backend.train_step(batch), device)
    if args.sync_debug:
        from rl_fsdp.profiling import sync_points

        SYNCS.update(PROFILE.get("syncs") or sync_points(lambda: backend.train_step(batch), device))
        _log(f"host syncs in one step: {SYNCS['total']}")
    if args.host_profile:
        from rl_fsdp.profiling import host_profile

        HOST.update(host_profile(lambda: backend.train_step(batch), device))
        _log(f"host profile: {HOST['functions'][:3]}")
    return step_s, backend


def _fsdp_config(args, model_config: dict, device) -> FSDPConfig:
    return FSDPConfig(
        model_config=model_config,
        device=device.type,
        precision="bf16" if device.type == "cuda" else "fp32",
        attention=args.attention,
        activation_checkpointing=args.checkpointing,
        compile_layers=args.compile_layers,
        compile_blocks=_compile_blocks(args),
        compile_attention=not args.no_compile_attention,
        reshard_after_forward=True if args.reshard_after_forward else None,
        reshard_after_backward=True if args.reshard_after_backward else None,
        reduce_dtype="fp32" if args.reduce_fp32 else None,
        fsdp_on_one_rank=True if args.fsdp_on_one_rank else None,
        max_tokens_per_micro_batch=args.max_tokens,
        lr=1e-6,
    )


def _profile(step, device) -> None:
    """One step each under torch.profiler, CUDA's sync debug mode and the profiler with
    Python stacks (where the copies come from), into ``PROFILE``."""
    from rl_fsdp.profiling import step_report

    PROFILE.update(step_report(step, device))
    _log(f"profiled step: {PROFILE['busy_fraction']:.1%} busy, {PROFILE['categories_ms']}")
    _log(f"host syncs: {PROFILE['syncs']['total']}, copies: {PROFILE['copies']['total_ms']} ms")


def _compile_blocks(args) -> bool | None:
    if args.no_compile_blocks or args.compile_layers:
        return False
    return True if args.compile_blocks else None


PROFILE: dict = {}  # --profile: one more rl-fsdp step under torch.profiler
SYNCS: dict = {}  # --sync-debug: one more step under CUDA's sync debug mode
HOST: dict = {}  # --host-profile: one more step under cProfile


def levers(backend: FSDPBackend) -> dict:
    """What ran in rl-fsdp's step: the lever settings as resolved for this run."""
    world = backend.dist.world_size
    config = backend.config
    compiled, failed = fusion.compiled_count(backend.model)
    return {
        "compile_blocks": {
            "compiled_modules": compiled,
            "fell_back_to_eager": failed,
            "compiled_classes": fusion.compiled_classes(backend.model),
        },
        "compile_layers": config.compile_layers,
        "fsdp": modeling.is_fsdp(backend.model),
        "reshard_after_forward": modeling.reshard_after_forward(config, world),
        "reshard_after_backward": modeling.reshard_after_backward(config, world),
        "reduce_dtype": str(modeling.reduce_dtype(config, world)).removeprefix("torch."),
        "attention": backend.attention,
        "activation_checkpointing": config.activation_checkpointing,
    }


PEAK_MEMORY_GIB: dict[str, float] = {}


def _timed(step, steps: int, device, name: str) -> float:
    """Seconds per step after one warm-up step; records the peak GPU memory under ``name``."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step()  # warm-up: allocator, kernels, lazy state, compilation
    _log(f"{name}: warm-up step done")
    start = _now(device)
    for _ in range(steps):
        step()
    seconds = (_now(device) - start) / steps
    if device.type == "cuda":
        PEAK_MEMORY_GIB[name] = torch.cuda.max_memory_allocated(device) / 2**30
    _log(f"{name}: {seconds:.3f} s per step")
    return seconds


def main(argv=None) -> dict:
    args = parse_args(argv)
    fusion.UNBACKED_TOKENS = False if args.backed_tokens else True if args.unbacked_tokens else None
    fusion.NON_STRICT_MIX_ORDER = not args.strict_mix_order
    if args.host_threads:
        torch.set_num_threads(args.host_threads)
    device = pick_device(args)
    big = args.shape != "tiny"
    full = args.data == "full"
    loop = args.data == "loop"  # the colocated GPU example's shape: 1024 x (4 + 1..64)
    if args.max_len is None:
        args.max_len = 64 if loop else (2048 if full else 4096) if big else 64
    if args.num_seqs is None:
        args.num_seqs = (1024 if big else 64) if loop else (4 if full else 16) if big else 8
    if args.max_tokens is None:
        args.max_tokens = 16384 if big and loop else 8192 if big else 256
    gen = torch.Generator().manual_seed(0)
    model_config = {"model_type": "qwen2", **SHAPES[args.shape]}
    if args.data == "loop":
        return loop_main(args, model_config, device, gen)
    batch = make_batch(lengths_for(args, gen), model_config["vocab_size"], gen)
    peak = matmul_tflops(device)
    _log(f"matmul rate {peak:.0f} TFLOP/s")
    fsdp_s, backend = fsdp_step(args, model_config, batch, device)
    compiled = compile_report() if "torch._dynamo" in sys.modules else {}
    flops = train_flops(
        backend.model_config,
        num_tokens=batch.num_tokens,
        attn_tokens_sq=sum(n * n for n in batch.seq_lengths()),
    )
    attention, lever_report = backend.attention, levers(backend)
    del backend
    _free(device)
    baseline_s = plain_hf_loop(args, model_config, batch, device) if args.baseline_steps else None
    result = {
        "bench": "train_fsdp",
        "shape": args.shape,
        "data": args.data,
        "num_tokens": batch.num_tokens,
        "seq_lengths": {"min": min(batch.seq_lengths()), "max": max(batch.seq_lengths())},
        "figure": {
            "tokens_per_s": batch.num_tokens / fsdp_s,
            "mfu": flops / fsdp_s / (peak * 1e12),
            "attention": attention,
            "activation_checkpointing": args.checkpointing,
            "compile_layers": args.compile_layers,
            "levers": lever_report,
            "compile": compiled,
            "fallback_errors": FALLBACK_ERRORS + fusion.COMPILE_FAILURES + PROBE_ERRORS,
            "steps": args.steps,
            "host_threads": torch.get_num_threads(),
            "peak_memory_gib": PEAK_MEMORY_GIB.get("figure"),
            **({"profile": PROFILE} if args.profile else {}),
            **({"syncs": SYNCS} if args.sync_debug else {}),
            **({"host_profile": HOST} if args.host_profile else {}),
        },
        "baseline": baseline_report(args, batch, flops, peak, baseline_s),
        "ratio": baseline_s / fsdp_s if baseline_s else None,
        "matmul_tflops": peak,
        **_provenance(device),
    }
    print(json.dumps(result, indent=2))
    return result


def _provenance(device) -> dict:
    """Where, with what and when a result was measured."""
    return {
        "hardware": _hardware(device),
        "versions": {"torch": torch.__version__, "transformers": _transformers_version()},
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def loop_main(args, model_config: dict, device, gen) -> dict:
    """--data loop: ``--steps`` loop steps on new batches; what each compiled."""
    backend = FSDPBackend(_fsdp_config(args, model_config, device))
    _log(f"rl-fsdp built (attention {backend.attention}, levers {levers(backend)})")
    reasons = _recompile_log()
    steps = [_loop_step(args, backend, device, gen, reasons, n) for n in range(args.steps)]
    if args.profile:
        _profile(lambda: _loop_step(args, backend, device, gen, reasons, args.steps), device)
    result = {
        "bench": "train_fsdp",
        "shape": args.shape,
        "data": "loop",
        "figure": {
            "attention": backend.attention,
            "levers": levers(backend),
            "compile": compile_report(),
            "loop": {
                "num_seqs": args.num_seqs,
                "prompt_len": args.prompt_len,
                "max_response": args.max_len,
                "minibatches": args.minibatches,
                "max_tokens": args.max_tokens,
                "unbacked_tokens": fusion.UNBACKED_TOKENS,
                "non_strict_mix_order": fusion.NON_STRICT_MIX_ORDER,
                "recompiles_after_first_step": sum(s["recompiles"] for s in steps[1:]),
                "frames_compiled_after_first_step": sum(s["frames_compiled"] for s in steps[1:]),
                "steps": steps,
            },
            "fallback_errors": FALLBACK_ERRORS + fusion.COMPILE_FAILURES + PROBE_ERRORS,
            "profile": PROFILE or None,
        },
        **_provenance(device),
    }
    print(json.dumps(result, indent=2))
    return result


def _loop_step(args, backend: FSDPBackend, device, gen, reasons: list[str], n: int) -> dict:
    """One loop step: log-probs over the batch, then one optimizer step per minibatch."""
    from torch._dynamo.utils import counters

    lengths = loop_lengths(gen, args.num_seqs, prompt=args.prompt_len, max_response=args.max_len)
    batch = make_batch(lengths, backend.model_config.vocab_size, gen)
    frames, logged, start = counters["frames"]["total"], len(reasons), _now(device)
    batch.old_log_probs = backend.compute_log_probs(batch)
    log_probs_s = _now(device) - start
    parts = round_robin_minibatches(batch, args.minibatches)
    for part in parts:
        backend.train_step(part)
    step = {
        "step": n + 1,
        "log_probs_s": log_probs_s,
        "train_s": _now(device) - start - log_probs_s,
        "minibatch_tokens": [part.num_tokens for part in parts],
        "longest": [max(part.seq_lengths()) for part in parts],
        "frames_compiled": counters["frames"]["total"] - frames,
        "recompiles": len(reasons) - logged,
        "reasons": [_reason(r) for r in reasons[logged:]],
    }
    _log(f"loop step {n + 1}: {step['train_s']:.2f} s train, {step['recompiles']} recompiles")
    return step


def _recompile_log() -> list[str]:
    """The recompile messages dynamo logs from now on (its "recompiles" artifact)."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(Keep())
    return messages


def _reason(message: str) -> str:
    """A recompile message's function and first failed guard, on one line."""
    lines = [line.strip() for line in message.splitlines()]
    guards = [line for line in lines if line.startswith("- ")]
    return f"{lines[0][:120]} | {guards[0][:200] if guards else ''}"


def _hardware(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def pick_device(args) -> torch.device:
    if args.device != "auto":
        return torch.device(args.device)
    return torch.device("cuda" if torch.cuda.is_available() and args.shape != "tiny" else "cpu")


def baseline_report(args, batch: TrainBatch, flops: float, peak: float, seconds) -> dict:
    """The plain loop's figures, or what says it did not run (--baseline-steps 0)."""
    report = {
        "name": "plain HF loop (padded, SDPA, HF cross-entropy, fused AdamW)",
        "activation_checkpointing": not args.baseline_no_checkpointing,
        "steps": args.baseline_steps,
    }
    if seconds is None:
        return {**report, "skipped": "--baseline-steps 0"}
    return {
        **report,
        "tokens_per_s": batch.num_tokens / seconds,
        "mfu": flops / seconds / (peak * 1e12),
        "peak_memory_gib": PEAK_MEMORY_GIB.get("baseline"),
    }


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
