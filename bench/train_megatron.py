"""Training-step throughput of rl-megatron's MegatronBackend against a plain HF loop.

Same model shapes (Qwen2.5-0.5B / 1.5B architecture, random weights) and the same batch as
bench/train_fsdp.py (--data full: 4 × 2048 tokens; varlen: 16 sequences of 128..4096;
micro-batches of --max-tokens). --data varied is RL-like: a new batch every step, 8
sequences of lengths drawn uniformly from [max_len / 4, max_len] (seeded by the step), so
the micro-batch shapes change from step to step; see "Varied data" below. Both sides run
one PPO step per iteration with rl_core's objective and torch AdamW: Megatron with
--precision (on cuda bf16 parameters, fp32 main gradients and fp32 master weights, as
Megatron trains), the baseline a plain HF loop (fp32 weights, bf16 autocast, padded rows,
no activation checkpointing) measured in the same run.
MFU is against the bf16 matmul rate measured here. Prints one JSON object.

  python bench/train_megatron.py --shape tiny --device cpu               # CPU smoke run (shim)
  python bench/train_megatron.py --shape 1.5b --device cuda --data full  # one GPU
  python bench/train_megatron.py --shape 1.5b --device cuda --data varied --steps 8 \
      --attention-backends no_cudnn --width-bucket 64    # new shapes each step, remedies
  python bench/train_megatron.py --shape 1.5b --device cuda --tp 2       # TP=2 (+SP), 2 GPUs
  python bench/train_megatron.py --shape 1.5b --device cuda --data full --ablate  # + lever off
  python bench/train_megatron.py --shape 1.5b --device cuda --dp 2        # ZeRO-1 over 2 GPUs
  python bench/train_megatron.py --shape 1.5b --device cuda --data full --profile \
      --megatron '{"recompute_granularity": "full", "recompute_method": "uniform",
                   "recompute_num_layers": 1}'    # + megatron-core options, where time goes

``--megatron`` passes megatron-core options by name (``MegatronConfig.megatron``: activation
recompute, ``use_distributed_optimizer``, ...); ``--dp`` adds data-parallel ranks (world =
tp x dp, ZeRO-1 by default), each training the whole batch (weak scaling: tokens per GPU as
at dp 1, so the figure is comparable; with the batch split instead, a 1.5B model's
gradient all-reduce and optimizer step over 4 x 2048 tokens would dominate). ``--profile`` runs one more step
under torch.profiler after the timed ones (``figure.profile``, rank 0's: device-busy
fraction, top kernels, time by category; rl_fsdp.profiling, the same summary as
bench/train_fsdp.py's), then one under CUDA's sync debug mode (``figure.profile.syncs``:
where the host waited, by source line) and one with Python stacks
(``figure.profile.copies``: copy, memset and NCCL device time by launching operator and
call site; host<->device memcpys under ``host_device``). Peak memory is rank 0's
``max_memory_allocated``.

Levers (on by default on cuda): the fused SwiGLU (--no-swiglu-fusion turns it off) and one
torch.compile'd graph per transformer layer (--no-compile-layers; rl_megatron.compiled_layers;
``figure.compile`` counts graph breaks, graphs and fallbacks); on every device, the rotary
embedding from a cos/sin table made once per length (--no-rotary-table: megatron's cos and
sin in every layer; rl_megatron.rotary). Off by default until measured: queries and keys
rotated straight from the fused q/k/v projection by one Triton kernel each way
(--fused-qkv-rotary; rl_megatron.qkv_rotary). --ablate also measures the step with each
lever off in the same run, reported under "ablations".

Varied data (--data varied): kernels that plan or compile per input shape (cuDNN's fused
attention, which SDPA picks first on Hopper) pay for every new micro-batch shape, which a
fixed batch never shows. --warmup steps run on batches of their own (compilation), then
--steps fresh batches are timed one by one (the first pass: shapes mostly new, as in an RL
run) and the same batches again (the second pass: every shape seen). ``figure.per_step``
holds both passes' seconds per step, each step's padded micro-batch shapes ``[rows,
width]``, how many were new, torch.compile's graph count after each first-pass step (a
rise: that step compiled), and ``new_shape_cost_s``, the pass difference per new shape;
the figure's throughput is the first pass's, ``figure.steady`` the second's. Remedies:
--attention-backends no_cudnn (MegatronConfig.attention_backends: flash / efficient /
math only) and --width-bucket N (widths rounded up to a multiple of N: shapes repeat).
"""

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from model_shapes import SHAPES


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--dp", type=int, default=1, help="data parallel size (GPUs = tp x dp)")
    parser.add_argument(
        "--megatron", type=json.loads, default={}, help="megatron-core options, a JSON object"
    )
    parser.add_argument("--profile", action="store_true", help="profile one more step (rank 0)")
    parser.add_argument("--data", choices=["full", "varlen", "varied"], default="varlen")
    parser.add_argument("--num-seqs", type=int, default=None, help="sequences per step")
    parser.add_argument("--max-len", type=int, default=None, help="longest sequence")
    parser.add_argument("--max-tokens", type=int, default=None, help="micro-batch token budget")
    parser.add_argument(
        "--precision", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda"
    )
    parser.add_argument(
        "--swiglu-fusion",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="megatron's compiled SwiGLU (default: on for cuda, off for cpu)",
    )
    parser.add_argument(
        "--compile-layers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one compiled graph per transformer layer (default: on for cuda, off for cpu)",
    )
    parser.add_argument(
        "--rotary-table",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="rotary embedding from a cos/sin table made once (rl_megatron.rotary)",
    )
    parser.add_argument(
        "--fused-qkv-rotary",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="queries and keys rotated straight from the q/k/v projection, one Triton kernel "
        "each way (rl_megatron.qkv_rotary; default: MegatronConfig's)",
    )
    parser.add_argument(
        "--attention-backends",
        choices=["auto", "no_cudnn"],
        default=None,
        help="SDPA kernels of core attention (default: MegatronConfig's)",
    )
    parser.add_argument(
        "--width-bucket",
        type=int,
        default=None,
        help="round padded row widths up to a multiple of this (default: MegatronConfig's)",
    )
    parser.add_argument(
        "--ablate", action="store_true", help="also run the step with each lever off"
    )
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    big, short = args.shape != "tiny", args.data in ("full", "varied")
    args.max_len = args.max_len or ((2048 if short else 4096) if big else 64)
    num_seqs = {"full": 4, "varlen": 16, "varied": 8}[args.data]
    args.num_seqs = args.num_seqs or (num_seqs if big else 8)
    args.max_tokens = args.max_tokens or (8192 if big else 256)
    return args


def make_batch(args, vocab_size: int):
    """The batch bench/train_fsdp.py trains on for the same arguments (its builder, the same
    generator use), with advantages for PPO; --data varied: the first timed batch."""
    from train_batches import lengths_for
    from train_batches import make_batch as packed_batch

    if args.data == "varied":
        return varied_batches(args, vocab_size)[1][0]
    gen = torch.Generator().manual_seed(0)
    return packed_batch(lengths_for(args, gen), vocab_size, gen)


def varied_batches(args, vocab_size: int):
    """``(warmup batches, timed batches)`` of --data varied: each step's num_seqs lengths
    uniform in [max_len / 4, max_len], seeded by the step (warm-up steps seeds 1000 on)."""
    from train_batches import make_batch as packed_batch

    def batch(seed: int):
        gen = torch.Generator().manual_seed(seed)
        low = max(args.max_len // 4, 2)
        lengths = torch.randint(low, args.max_len + 1, (args.num_seqs,), generator=gen).tolist()
        return packed_batch(lengths, vocab_size, gen)

    warmup = [batch(1000 + step) for step in range(args.warmup)]
    return warmup, [batch(step) for step in range(args.steps)]


def matmul_flops_per_s(device: str) -> float:
    """Measured dense matmul rate: bf16 8192³ on GPU, fp32 1024³ on CPU."""
    size, dtype = (8192, torch.bfloat16) if device == "cuda" else (1024, torch.float32)
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    _sync(device)
    reps = 20 if device == "cuda" else 5
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * size**3 * reps / (time.perf_counter() - start)


def step_flops(config, lengths: list[int]) -> float:
    """6 × matmul parameters × tokens (LM head in, embeddings out) + causal attention."""
    h, layers = config.hidden_size, config.num_hidden_layers
    head_dim = h // config.num_attention_heads
    qkv = h * (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    matmul_params = layers * (qkv + h * h + 3 * h * config.intermediate_size)
    matmul_params += h * config.vocab_size
    attention = 6 * layers * h * sum(n * n for n in lengths)  # 3 × (2 · 2·n²·h / 2, causal)
    return 6 * matmul_params * sum(lengths) + attention


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def seconds_per_step(step, args) -> float:
    for _ in range(args.warmup):
        step()
    _sync(args.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    _sync(args.device)
    return (time.perf_counter() - start) / args.steps


def varied_timings(step, shapes_of, warmup: list, timed: list, device: str) -> dict:
    """--data varied: warm-up batches, then the timed batches twice (first pass: shapes
    new unless an earlier batch had them; second pass: all seen). Per step: seconds of
    both passes, padded micro-batch shapes, how many were new."""
    seen: set = set()
    for batch in warmup:
        step(batch)
        seen.update(shapes_of(batch))
    _sync(device)
    shapes, new = [], []
    for batch in timed:
        mine = [tuple(shape) for shape in shapes_of(batch)]
        shapes.append(mine)
        new.append(len(set(mine) - seen))
        seen.update(mine)
    first, graphs = _timed(step, timed, device)
    second, _ = _timed(step, timed, device)
    extra = sum(first) - sum(second)
    return {
        "first_pass_s": first,
        "second_pass_s": second,
        "compiled_graphs": graphs,
        "shapes": shapes,
        "new_shapes": new,
        "distinct_shapes": len(seen),
        "new_shape_cost_s": extra / sum(new) if sum(new) else None,
        "first_pass_mean_s": statistics.fmean(first),
        "second_pass_mean_s": statistics.fmean(second),
    }


def _timed(step, batches: list, device: str) -> tuple[list[float], list[int]]:
    """Seconds of each step and torch.compile's graph count after it (a step that grew it
    includes a compilation: dynamo specialises a dimension of size 1, e.g. a one-row
    micro-batch)."""
    from torch._dynamo.utils import counters

    seconds, graphs = [], []
    for batch in batches:
        start = time.perf_counter()
        step(batch)
        _sync(device)
        seconds.append(time.perf_counter() - start)
        graphs.append(counters["stats"]["unique_graphs"])
    return seconds, graphs


def hf_baseline(model, batch, args) -> float:
    """Seconds per step of a plain loop: padded rows (max_tokens // max_len per forward),
    HF forward with bf16 autocast on GPU, rl_core log-probs and objective, AdamW."""
    from rl_core.logprobs import log_probs_from_logits
    from rl_core.objective import policy_objective
    from rl_core.packing import pad_packed

    model = model.to(args.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch = batch.to(args.device)
    tokens, valid = pad_packed(batch.tokens, batch.cu_seqlens)
    mask, _ = pad_packed(batch.loss_mask, batch.cu_seqlens)
    advantages, _ = pad_packed(batch.advantages, batch.cu_seqlens)
    rows = max(1, args.max_tokens // args.max_len)

    def step():
        for start in range(0, tokens.shape[0], rows):
            part = slice(start, start + rows)
            width = int(valid[part].sum(1).max())
            ids = tokens[part, :width]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.device == "cuda"):
                logits = model(ids, attention_mask=valid[part, :width].long()).logits
            log_probs = log_probs_from_logits(logits, torch.roll(ids, -1, dims=1))
            loss, _ = policy_objective(
                log_probs=log_probs,
                old_log_probs=log_probs.detach(),
                advantages=advantages[part, :width],
                mask=mask[part, :width],
                num_tokens=batch.global_num_tokens,
            )
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return seconds_per_step(step, args)


def megatron_worker(
    rank: int, args, hf_dir: str, port: int, out_path: str, overrides: dict
) -> None:
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    if args.device == "cpu":
        from rl_megatron.testing import cpu_shim

        cpu_shim.install()
    else:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=args.tp * args.dp
    )
    config = MegatronConfig(
        hf_path=hf_dir,
        tp=args.tp,
        device=args.device,
        lr=1e-6,
        max_tokens_per_micro_batch=args.max_tokens,
        sequence_parallel=args.tp > 1,
        precision=args.precision,
        megatron=args.megatron,
        **{
            "swiglu_fusion": args.swiglu_fusion,
            "compile_layers": args.compile_layers,
            "rotary_table": args.rotary_table,
            **(
                {} if args.fused_qkv_rotary is None else {"fused_qkv_rotary": args.fused_qkv_rotary}
            ),
            **_given(attention_backends=args.attention_backends, width_bucket=args.width_bucket),
            **overrides,
        },
    )
    backend = MegatronBackend(config)
    batch = make_batch(args, backend.shape.vocab_size)  # every data-parallel rank: all of it
    per_step = None
    if args.data == "varied":
        warmup, timed = varied_batches(args, backend.shape.vocab_size)
        per_step = varied_timings(
            backend.train_step, backend.micro_batch_shapes, warmup, timed, args.device
        )
        seconds = per_step["first_pass_mean_s"]
    else:
        seconds = seconds_per_step(lambda: backend.train_step(batch), args)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    profile = None
    if args.profile:  # after the timed steps, one more step each (every rank runs them)
        from rl_fsdp.profiling import step_report

        profile = step_report(lambda: backend.train_step(batch), torch.device(args.device))
    if rank == 0:
        levers = {
            "swiglu_fusion": backend.model.config.bias_activation_fusion,
            "compile_layers": backend.compiled_layers,  # {} when off
            "rotary_table": backend.config.rotary_table,
            "fused_qkv_rotary": backend.model.config.fused_single_qkv_rope,  # where it applies
            "attention_backends": backend.config.attention_backends,
            "width_bucket": backend.config.width_bucket,
        }
        result = {"seconds": seconds, "peak_memory_gib": peak, "levers": levers}
        if per_step:
            result["per_step"] = per_step
        if backend.compiled_layers:
            from rl_core.compiling import compile_report

            result["compile"] = compile_report()
        with open(out_path, "w") as f:
            json.dump({**result, **({"profile": profile} if profile else {})}, f)
    dist.destroy_process_group()


def _given(**options) -> dict:
    """The options set on the command line (None: MegatronConfig's default)."""
    return {name: value for name, value in options.items() if value is not None}


def run_megatron(args, hf_dir: str, overrides: dict) -> dict:
    """``{seconds, peak_memory_gib, levers}`` of the backend's step (one process per GPU)."""
    out_path = os.path.join(hf_dir, "megatron.json")
    mp.spawn(
        megatron_worker,
        args=(args, hf_dir, free_port(), out_path, overrides),
        nprocs=args.tp * args.dp,
        join=True,
    )
    with open(out_path) as f:
        return json.load(f)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hardware(device: str, num_gpus: int) -> str:
    if device == "cuda":
        return f"{num_gpus}× {torch.cuda.get_device_name()}"
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def main():
    import transformers
    from transformers import AutoModelForCausalLM, Qwen2Config

    args = parse_args()
    torch.manual_seed(0)
    config = Qwen2Config(max_position_embeddings=max(32768, args.max_len), **SHAPES[args.shape])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    batch = make_batch(args, config.vocab_size)
    rate = matmul_flops_per_s(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        baseline_s = hf_baseline(model, batch, args)
        baseline_peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
        figure = run_megatron(args, tmp, {})
        ablations = {
            "swiglu_fusion_off": {"swiglu_fusion": False},
            "compile_layers_off": {"compile_layers": False},
            "rotary_table_off": {"rotary_table": False},
            "fused_qkv_rotary_off": {"fused_qkv_rotary": False},
        }
        ablations = ablations if args.ablate else {}
        ablated = {name: run_megatron(args, tmp, kw) for name, kw in ablations.items()}
    # per step: the batch's, or the mean over --data varied's timed batches
    timed = varied_batches(args, config.vocab_size)[1] if args.data == "varied" else [batch]
    num_tokens = statistics.fmean(b.num_tokens for b in timed)
    flops = statistics.fmean(step_flops(config, b.seq_lengths()) for b in timed)
    baseline_flops = step_flops(config, batch.seq_lengths())
    gpus = args.tp * args.dp if args.device == "cuda" else 1

    def throughput(seconds: float, dp: int = 1) -> dict:
        """Over all data-parallel ranks (each trains the step's batch) and all GPUs."""
        tokens, work = num_tokens * dp, flops * dp
        return {"tokens_per_s": tokens / seconds, "mfu": work / seconds / (rate * gpus)}

    figure_rate = throughput(figure["seconds"], args.dp)
    baseline_rate = batch.num_tokens / baseline_s
    varied = {}
    if "per_step" in figure:
        steady = throughput(figure["per_step"]["second_pass_mean_s"], args.dp)
        varied = {"steady": steady, "per_step": figure["per_step"]}

    print(
        json.dumps(
            {
                "bench": "train_megatron",
                "shape": args.shape,
                "data": args.data,
                "tp": args.tp,
                "dp": args.dp,
                "megatron": args.megatron,
                "num_tokens": num_tokens,
                "figure": {
                    "name": "MegatronBackend train_step",
                    "precision": args.precision or ("bf16" if args.device == "cuda" else "fp32"),
                    **figure_rate,
                    "peak_memory_gib": figure["peak_memory_gib"],
                    "levers": figure["levers"],
                    **varied,
                    **{key: figure[key] for key in ("compile", "profile") if key in figure},
                },
                "ablations": {
                    name: {**throughput(run["seconds"], args.dp), "levers": run["levers"]}
                    for name, run in ablated.items()
                },
                "baseline": {
                    "name": "plain HF loop (padded rows, SDPA, rl_core PPO, AdamW), one device"
                    + (", the first timed batch repeated" if varied else ""),
                    "tokens_per_s": baseline_rate,
                    "mfu": baseline_flops / baseline_s / rate,
                    "peak_memory_gib": baseline_peak,
                },
                "ratio": figure_rate["tokens_per_s"] / baseline_rate,  # tokens/s against it
                "matmul_tflops": rate / 1e12,
                "hardware": hardware(args.device, gpus),
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                "command": "python " + " ".join(sys.argv),
                "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
