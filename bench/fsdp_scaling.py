"""FSDP2 across ranks: log-prob / loss / grad-norm parity of N ranks with 1, and the
training step's throughput scaling from 1 rank to N.

One process group per world size (1, then N; torch.multiprocessing, one GPU per rank over
nccl, or gloo ranks on CPU), each rank running both phases on one FSDPBackend:

1. parity: the same global batch (--parity-seqs sequences of varied length), split over
   the ranks (rl_fsdp.shard_for_rank), gives per-token log-probs, then one train step
   (its loss/total with an entropy bonus, so the loss depends on the model, and the
   global gradient norm before clipping), then the log-probs after that AdamW step.
   World N is compared with world 1 token by token, each figure next to its tolerance
   (bf16 on GPU, float32 on CPU).
2. scaling: the training step (forward + backward + AdamW; FSDP2 over the ranks, the
   backend's defaults otherwise, so on one GPU float32 masters without FSDP unless
   --fsdp-on-one-rank) on a fixed per-rank batch (--data full: --num-seqs x --max-len
   per rank, 4 x 2048 on GPU), 1 warm-up step and --steps measured: tokens/s of the
   world (the slowest rank's time), MFU against the bf16 matmul rate measured on each
   GPU (bench/train_fsdp.py's helpers), and the efficiency tokens/s(N) / (N x tokens/s(1)).

Made for a one-shot GPU run: every phase and world size records its error text in the
JSON and the run goes on (with N ranks a failed phase ends that world's ranks, whose
collectives would otherwise wait for each other); a world size still running at
--time-limit-s is killed (the phases it finished are kept) and the JSON printed anyway. Progress goes to stderr with
timestamps; one JSON object to stdout (and to --out). No network is used.

    # CPU (gloo, 2 ranks, tiny shape)
    python bench/fsdp_scaling.py --steps 1
    # GPU machine with 2 GPUs (nccl, 1.5b shape, 4 x 2048 tokens per rank)
    PYTHONPATH=$(ls -d packages/*/src | tr '\\n' ':') python bench/fsdp_scaling.py \\
        --out $OUT/fsdp_scaling.json
"""

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp
from model_shapes import SHAPES
from train_batches import lengths_for, make_batch
from train_fsdp import _now, levers, matmul_tflops

from rl_core.distributed import free_port, init_distributed
from rl_core.packing import balanced_partitions
from rl_fsdp import FSDPBackend, FSDPConfig, fusion, shard_for_rank
from rl_fsdp.distributed import all_reduce_max_int
from rl_fsdp.metrics import train_flops
from rl_fsdp.torch_varlen import PROBE_ERRORS

# Tolerances of world N against world 1: float32 on CPU, bf16 compute on GPU (the same
# bf16 weights, other micro-batch shapes and reduction orders, fp32 vs bf16 grad reduce).
TOLERANCES = {
    "fp32": {"log_probs_max": 1e-4, "log_probs_mean": 1e-5, "loss_rel": 1e-4, "grad_rel": 1e-4},
    "bf16": {"log_probs_max": 0.1, "log_probs_mean": 0.01, "loss_rel": 0.01, "grad_rel": 0.05},
}
PARITY_ENTROPY_COEF = 0.01  # on-policy PPO alone has a loss of -mean(advantage) exactly


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--world-size", type=int, default=None, help="N (GPUs, or 2 on CPU)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="1.5b GPU, tiny CPU")
    parser.add_argument("--data", choices=["full", "varlen"], default="full")
    parser.add_argument("--num-seqs", type=int, default=None, help="sequences per rank")
    parser.add_argument("--max-len", type=int, default=None, help="longest sequence")
    parser.add_argument("--max-tokens", type=int, default=None, help="packed micro-batch budget")
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after 1 warm-up)")
    parser.add_argument("--parity-seqs", type=int, default=8, help="sequences of the batch")
    parser.add_argument("--parity-max-len", type=int, default=None, help="512 GPU, 64 CPU")
    parser.add_argument("--parity-lr", type=float, default=1e-4, help="lr of the parity step")
    parser.add_argument("--no-parity", action="store_true", help="throughput only")
    parser.add_argument("--no-scaling", action="store_true", help="parity only")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument("--no-compile-blocks", action="store_true", help="eager MLPs and norms")
    parser.add_argument("--fsdp-on-one-rank", action="store_true", help="FSDP2 at world 1 too")
    parser.add_argument("--time-limit-s", type=float, default=300.0, help="whole run, seconds")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.device = "cuda" if cuda else "cpu"
    if args.world_size is None:
        args.world_size = torch.cuda.device_count() if cuda else 2
    if args.shape is None:
        args.shape = "1.5b" if cuda else "tiny"
    big = args.shape != "tiny"
    full = args.data == "full"
    if args.max_len is None:
        args.max_len = (2048 if full else 4096) if big else 64
    if args.num_seqs is None:
        args.num_seqs = (4 if full else 16) if big else 8
    if args.max_tokens is None:
        args.max_tokens = 8192 if big else 256
    if args.parity_max_len is None:
        args.parity_max_len = 512 if big else 64
    return args


# The driver's start (inherited by the spawned ranks): every progress line counts from it.
_T0 = float(os.environ.setdefault("FSDP_SCALING_T0", repr(time.time())))


def _log(message: str, rank: int | None = None) -> None:
    who = "" if rank is None else f"rank {rank}: "
    stamp = datetime.now(UTC).strftime("%H:%M:%S")
    elapsed = time.time() - _T0
    print(f"[{stamp} {elapsed:6.1f} s] {who}{message}", file=sys.stderr, flush=True)


def _error(err: BaseException) -> str:
    text = "".join(traceback.format_exception(err))
    return text if len(text) <= 3000 else text[:1000] + "\n...\n" + text[-2000:]


# --- one rank ------------------------------------------------------------------------------
def worker(rank: int, world: int, port: int, workdir: str, deadline: float) -> None:
    """Both phases on one backend; results saved to ``rank{rank}.pt`` after each phase.
    A failing phase is recorded; with several ranks it then ends the rank (the others'
    collectives would wait for it), on one rank the next phase runs."""
    os.dup2(2, 1)  # stdout holds the driver's JSON only: anything a rank prints goes to stderr
    spec = torch.load(Path(workdir) / "spec.pt", weights_only=False)
    args = spec["args"]
    # the same host threads per rank at every world size (on CPU: the same compute per rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    out = {"rank": rank, "world_size": world}
    path = Path(workdir) / f"rank{rank}.pt"

    def save():
        torch.save(out, path)

    dist_info = init_distributed(
        device=args.device,
        rank=rank,
        world_size=world,
        master_addr="127.0.0.1",
        master_port=port,
        timeout_s=max(60.0, deadline - time.time()),
    )
    try:
        device = dist_info.device
        out["matmul_tflops"] = matmul_tflops(device)
        _log(f"matmul rate {out['matmul_tflops']:.3g} TFLOP/s on {device}", rank)
        backend = FSDPBackend(_config(args), dist_info=dist_info)
        out["levers"] = levers(backend)
        _log(f"backend built: {out['levers']}", rank)
        phases = [("parity", _parity), ("scaling", _scaling)]
        for name, phase in phases:
            if getattr(args, f"no_{name}"):
                continue
            if time.time() > deadline:
                out[name] = {"error": "skipped: --time-limit-s reached"}
                continue
            try:
                out[name] = phase(backend, spec, dist_info)
                _log(f"{name} done", rank)
            except Exception as err:
                out[name] = {"error": _error(err)}
                _log(f"{name} failed: {err!r}", rank)
                if world > 1:
                    raise
            finally:
                out["compile_failures"] = list(fusion.COMPILE_FAILURES)
                out["probe_errors"] = list(PROBE_ERRORS)
                save()
    except Exception as err:
        out.setdefault("error", _error(err))
        save()
        raise  # no destroy_process_group: it could wait for a rank that is stuck
    torch.distributed.destroy_process_group()


def _config(args) -> FSDPConfig:
    cuda = args.device == "cuda"
    return FSDPConfig(
        model_config={"model_type": "qwen2", **SHAPES[args.shape]},
        device=args.device,
        precision="bf16" if cuda else "fp32",
        attention=args.attention,
        activation_checkpointing=args.checkpointing,
        compile_blocks=False if args.no_compile_blocks else None,
        fsdp_on_one_rank=True if args.fsdp_on_one_rank else None,
        max_tokens_per_micro_batch=args.max_tokens,
        lr=args.parity_lr,
    )


def _parity(backend: FSDPBackend, spec: dict, dist_info) -> dict:
    """This rank's log-probs before and after one train step, and the step's metrics."""
    local = shard_for_rank(spec["parity_batch"], dist_info.rank, dist_info.world_size)
    before = backend.compute_log_probs(local).float().cpu()
    config = backend.config
    objective = dataclasses.replace(config.objective, entropy_coef=PARITY_ENTROPY_COEF)
    backend.config = dataclasses.replace(config, objective=objective)
    try:
        metrics = backend.train_step(local)
    finally:
        backend.config = config
    after = backend.compute_log_probs(local).float().cpu()
    return {"log_probs": before, "log_probs_after_step": after, "metrics": metrics}


def _scaling(backend: FSDPBackend, spec: dict, dist_info) -> dict:
    """Seconds of this rank per training step over the world's batch (1 warm-up step)."""
    args, device = spec["args"], dist_info.device
    batch = spec["scaling_batches"][dist_info.world_size]
    local = shard_for_rank(batch, dist_info.rank, dist_info.world_size)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    backend.train_step(local)
    _log("warm-up step done", dist_info.rank)
    all_reduce_max_int(0, device)  # the ranks start the clock together
    start = _now(device)
    for _ in range(args.steps):
        metrics = backend.train_step(local)
    seconds = (_now(device) - start) / args.steps
    _log(f"{seconds:.3f} s per step", dist_info.rank)
    return {
        "step_s": seconds,
        "local_tokens": local.num_tokens,
        "nonfinite_skipped": metrics.get("train/nonfinite_skipped"),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
    }


# --- the driver ----------------------------------------------------------------------------
def run_world(world: int, spec: dict, workdir: Path, deadline: float) -> dict:
    """Spawn ``world`` ranks; their saved results (or the error that ended them)."""
    for old in workdir.glob("rank*.pt"):
        old.unlink()
    torch.save(spec, workdir / "spec.pt")
    start = time.perf_counter()
    report: dict = {}
    context = mp.start_processes(
        worker,
        args=(world, free_port(), str(workdir), deadline),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    try:
        while not context.join(timeout=2.0):
            if time.time() > deadline:
                report["error"] = "killed at --time-limit-s"
                _log(f"world {world}: {report['error']}")
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                for process in context.processes:
                    process.join(10)
                break
    except Exception as err:  # a rank raised or died; join() ended the others
        report["error"] = _error(err)
    report["seconds"] = time.perf_counter() - start
    report["ranks"] = [
        torch.load(workdir / f"rank{r}.pt", weights_only=False)
        for r in range(world)
        if (workdir / f"rank{r}.pt").exists()
    ]
    return report


def assemble(partitions: list[list[int]], batch, per_rank: list[torch.Tensor]) -> torch.Tensor:
    """The global ``[N]`` tensor from each rank's values over its sequences (in order)."""
    bounds = batch.cu_seqlens.tolist()
    out = torch.full((batch.num_tokens,), float("nan"))
    for seqs, values in zip(partitions, per_rank, strict=True):
        offset = 0
        for seq in seqs:
            n = bounds[seq + 1] - bounds[seq]
            out[bounds[seq] : bounds[seq + 1]] = values[offset : offset + n]
            offset += n
    return out


def parity_report(args, batch, runs: dict[int, dict]) -> dict:
    tol = TOLERANCES["bf16" if args.device == "cuda" else "fp32"]
    worlds = (1, args.world_size)
    one, many = (runs[w]["ranks"] if w in runs else [] for w in worlds)
    complete = len(one) == 1 and len(many) == args.world_size
    if not complete or any("parity" not in r or "error" in r["parity"] for r in one + many):
        return {
            "error": "no parity result from every rank (see runs)",
            "ranks_with_results": {
                f"world_{w}": len(r) for w, r in zip(worlds, (one, many), strict=True)
            },
            "rank_errors": _rank_errors(one + many),
        }
    partitions = balanced_partitions(batch.seq_lengths(), args.world_size)
    mask = batch.loss_mask.bool()  # sequence ends carry 0 and are no prediction
    report: dict = {"world_sizes": [1, args.world_size], "num_tokens": batch.num_tokens}
    for key in ("log_probs", "log_probs_after_step"):
        a = one[0]["parity"][key]
        b = assemble(partitions, batch, [r["parity"][key] for r in many])
        diff = (a - b).abs()[mask]
        report[key] = {
            "max_abs_diff": float(diff.max()),
            "mean_abs_diff": float(diff.mean()),
            "tolerance_max_abs": tol["log_probs_max"],
            "tolerance_mean_abs": tol["log_probs_mean"],
            "ok": bool(diff.max() <= tol["log_probs_max"] and diff.mean() <= tol["log_probs_mean"]),
        }
    change = (one[0]["parity"]["log_probs_after_step"] - one[0]["parity"]["log_probs"]).abs()
    report["step_change_mean_abs"] = float(change[mask].mean())  # what the step moved
    m1, mn = one[0]["parity"]["metrics"], many[0]["parity"]["metrics"]
    for name, key, tol_key in (
        ("loss", "loss/total", "loss_rel"),
        ("grad_norm", "train/grad_norm", "grad_rel"),
    ):
        rel = abs(m1[key] - mn[key]) / max(abs(m1[key]), 1e-12)
        report[name] = {
            "world_1": m1[key],
            f"world_{args.world_size}": mn[key],
            "abs_diff": abs(m1[key] - mn[key]),
            "rel_diff": rel,
            "tolerance_rel": tol[tol_key],
            "ok": rel <= tol[tol_key],
        }
    shared = sorted(k for k in m1.keys() & mn.keys() if k.split("/")[0] in ("loss", "actor", "pg"))
    report["metric_abs_diffs"] = {k: abs(m1[k] - mn[k]) for k in shared}
    report["entropy_coef"] = PARITY_ENTROPY_COEF
    report["lr"] = args.parity_lr
    report["ok"] = all(report[k]["ok"] for k in ("log_probs", "log_probs_after_step", "loss"))
    report["ok"] = report["ok"] and report["grad_norm"]["ok"]
    return report


def scaling_report(args, batches: dict, runs: dict[int, dict], model_config) -> dict:
    report: dict = {"per_rank_seqs": args.num_seqs, "max_len": args.max_len, "data": args.data}
    for world, run in runs.items():
        ranks = run["ranks"]
        entry: dict = {"ranks": len(ranks)}
        try:
            failed = any("scaling" not in r or "error" in r["scaling"] for r in ranks)
            if len(ranks) < world or failed:
                errors = _rank_errors(ranks)
                entry["error"] = errors[0] if errors else "no result from every rank (see runs)"
            else:
                batch = batches[world]
                step_s = max(r["scaling"]["step_s"] for r in ranks)  # the world waits for it
                peak = sum(r["matmul_tflops"] for r in ranks) / len(ranks)
                flops = train_flops(
                    model_config,
                    num_tokens=batch.num_tokens,
                    attn_tokens_sq=sum(n * n for n in batch.seq_lengths()),
                )
                entry.update(
                    tokens=batch.num_tokens,
                    step_s=step_s,
                    step_s_per_rank=[r["scaling"]["step_s"] for r in ranks],
                    tokens_per_s=batch.num_tokens / step_s,
                    tokens_per_s_per_rank=batch.num_tokens / step_s / world,
                    mfu=flops / step_s / (peak * 1e12 * world),
                    matmul_tflops=peak,
                    peak_memory_gib=[r["scaling"]["peak_memory_gib"] for r in ranks],
                    nonfinite_skipped=ranks[0]["scaling"]["nonfinite_skipped"],
                    levers=ranks[0].get("levers"),
                )
        except Exception as err:
            entry["error"] = _error(err)
        report[f"world_{world}"] = entry
    one, many = (report.get(f"world_{w}", {}) for w in (1, args.world_size))
    if "tokens_per_s" in one and "tokens_per_s" in many:
        report["efficiency"] = many["tokens_per_s"] / (args.world_size * one["tokens_per_s"])
        report["speedup"] = many["tokens_per_s"] / one["tokens_per_s"]
    else:
        report["efficiency"] = None
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = _T0
    deadline = t0 + args.time_limit_s
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off (these machines lack it)
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # no network
    result: dict = {
        "bench": "fsdp_scaling",
        "device": args.device,
        "world_size": args.world_size,
        "shape": args.shape,
        "precision": "bf16" if args.device == "cuda" else "fp32",
        "steps": args.steps,
        "max_tokens": args.max_tokens,
    }
    _log(f"device {args.device}, worlds 1 and {args.world_size}, shape {args.shape}")
    runs: dict[int, dict] = {}
    try:
        model_config = {"model_type": "qwen2", **SHAPES[args.shape]}
        vocab = model_config["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        parity_args = SimpleNamespace(
            data="varlen", max_len=args.parity_max_len, num_seqs=args.parity_seqs
        )
        parity_batch = make_batch(lengths_for(parity_args, gen), vocab, gen)
        batches = {}
        for world in (1, args.world_size):
            seqs = SimpleNamespace(data=args.data, max_len=args.max_len)
            seqs.num_seqs = args.num_seqs * world  # a fixed batch per rank
            batches[world] = make_batch(lengths_for(seqs, gen), vocab, gen)
        spec = {"args": args, "parity_batch": parity_batch, "scaling_batches": batches}
        if args.world_size < 2:
            raise ValueError(f"world size {args.world_size}: scaling needs 2 or more ranks")
        if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
            raise ValueError(f"{torch.cuda.device_count()} GPUs for {args.world_size} ranks")
        with tempfile.TemporaryDirectory(prefix="fsdp_scaling_") as tmp:
            for world in (1, args.world_size):
                if time.time() > deadline:
                    runs[world] = {"error": "skipped: --time-limit-s reached", "ranks": []}
                    continue
                _log(f"world {world}: starting {world} rank(s)")
                try:
                    runs[world] = run_world(world, spec, Path(tmp), deadline)
                except Exception as err:
                    runs[world] = {"error": _error(err), "ranks": []}
                _log(f"world {world}: done in {runs[world].get('seconds', 0):.1f} s")
    except Exception as err:
        result["error"] = _error(err)
    for name, report in (
        ("parity", lambda: parity_report(args, parity_batch, runs)),
        ("scaling", lambda: scaling_report(args, batches, runs, _hf_config(model_config))),
    ):
        try:
            result[name] = report()
        except Exception as err:
            result[name] = {"error": _error(err)}
    result["runs"] = {
        f"world_{w}": {
            "seconds": run.get("seconds"),
            "error": run.get("error"),
            "compile_failures": sorted(
                {f for r in run["ranks"] for f in r.get("compile_failures", [])}
            ),
            "probe_errors": sorted({e for r in run["ranks"] for e in r.get("probe_errors", [])}),
            "rank_errors": _rank_errors(run["ranks"]),
        }
        for w, run in runs.items()
    }
    result.update(
        hardware=_hardware(args.device),
        versions={"torch": torch.__version__, "transformers": _transformers_version()},
        seconds=time.time() - t0,
        command=" ".join(["python", *sys.argv]),
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    )
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return result


def _rank_errors(ranks: list[dict]) -> list[str]:
    """Distinct error texts of the ranks (a phase's, or what ended the rank)."""
    errors = [r.get(p, {}).get("error") for r in ranks for p in ("parity", "scaling")]
    errors += [r.get("error") for r in ranks]
    return list(dict.fromkeys(e for e in errors if e))


def _hf_config(model_config: dict):
    from transformers import AutoConfig

    fields = dict(model_config)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _hardware(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return platform.processor() or platform.machine()


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
