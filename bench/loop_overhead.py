"""Per-step orchestration overhead of rl-train's synchronous loop on CPU, quickstart model.

    .tox/launcher/bin/python bench/loop_overhead.py [--steps 30] [--warmup 3] [--json out.json]

overhead = median step wall time of the real loop (Ray actor, embedded engine behind the
sglang-router, HTTP, weight sync) - median time of the same step's compute done in one
process (one sampling forward for the batch's prompts, the log-prob forward, the
optimizer steps; the same model, batch shape - batch_size x group_size samples - and
minibatches). The target is <= 100 ms. The last line printed is the figures as JSON.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "quickstart" / "config.yaml"


def loop_steps(config, steps: int, warmup: int) -> list[dict]:
    from rl_launcher.buffer import DataBuffer
    from rl_launcher.run.loop import run_step
    from rl_launcher.run.setup import start_run

    run = start_run(config)
    try:
        buffer = DataBuffer.from_config(config, num_ranks=run.num_ranks)
        records = [run_step(run, buffer, step) for step in range(1, warmup + steps + 1)]
    finally:
        run.close()
    return records[warmup:]


def reference_steps(config, step_batches, model_dir: Path) -> list[float]:
    """The compute of each step in this process: sample, log-probs, optimizer steps."""
    from rl_fsdp import FSDPBackend
    from rl_launcher.run.loop import minibatches
    from rl_launcher.run.train_group import fsdp_config, with_old_log_probs

    backend = FSDPBackend(fsdp_config(config, model_dir=model_dir))
    times = []
    for batch in step_batches:
        start = time.perf_counter()
        with torch.no_grad():  # one forward over the prompts = the engine's sampling compute
            _ = backend.compute_log_probs(batch)
        old = backend.compute_log_probs(batch)
        (batch,) = with_old_log_probs([batch], [old])
        for part in minibatches([batch], config.algorithm.num_minibatches):
            backend.train_step(part[0])
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    from rl_core.batch import batch_from_samples
    from rl_core.types import Sample
    from rl_launcher.config_loader import load_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="loop_overhead_"))
    config, _ = load_config(["--config", str(CONFIG), "--logging.run_dir", str(run_dir),
                             "--logging.progress", "false"])  # fmt: skip
    records = loop_steps(config, args.steps, args.warmup)
    # the reference trains on batches shaped like the loop's: batch_size prompts x group_size
    # samples of a 4-token prompt ("3+4=") and a 1-token answer
    num = config.rollout.batch_size * config.rollout.group_size
    samples = [Sample(tokens=[5, 11, 4, 14, 8], response_length=1, index=i) for i in range(num)]
    batch = batch_from_samples(samples, [float(i % 2) - 0.5 for i in range(num)])
    reference = reference_steps(
        config, [batch] * (args.warmup + args.steps), run_dir / "initial_model"
    )
    reference = reference[args.warmup :]
    step = statistics.median(r["time/step"] for r in records)
    compute = statistics.median(reference)
    print(f"steps measured: {len(records)} (after {args.warmup} warm-up)")
    for part in ("rollout", "log_probs", "train", "sync"):
        print(
            f"  time/{part:<9} median {statistics.median(r[f'time/{part}'] for r in records) * 1e3:7.1f} ms"
        )
    print(f"loop step      median {step * 1e3:7.1f} ms")
    print(f"compute alone  median {compute * 1e3:7.1f} ms (single process)")
    print(f"overhead       {(step - compute) * 1e3:7.1f} ms per step (target <= 100 ms)")
    summary = {"step_ms": step * 1e3, "compute_ms": compute * 1e3,
               "overhead_ms": (step - compute) * 1e3, "steps": len(records),
               "samples_per_step": num, "cpu_count": os.cpu_count()} | {
        f"{part}_ms": statistics.median(r[f"time/{part}"] for r in records) * 1e3
        for part in ("rollout", "log_probs", "train", "sync")}  # fmt: skip
    print(json.dumps({k: round(v, 1) for k, v in summary.items()}))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
