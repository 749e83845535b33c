"""Per-step orchestration overhead of rl-train's loops on CPU, quickstart model.

    .tox/launcher/bin/python bench/loop_overhead.py [--steps 30] [--warmup 3] \
        [--loops sync,one_step_async,async] [--json out.json]

overhead = median over steps of (step wall time of the real loop: Ray actor, embedded
engine behind the sglang-router, HTTP, weight sync) - (time of the same step's compute done
in this process right after it: one sampling forward for the batch's prompts, the log-prob
forward, the optimizer steps; the same model, batch shape - batch_size x group_size
samples - and minibatches). Pairing each step with its own reference keeps the figure
fair on a machine shared with other jobs. The target is <= 100 ms.

In the one-step-async and async loops generation overlaps training, so their step can
hide generation and the overhead can come out below the synchronous loop's (below zero
where generation and training really run at once). The trainer's share of the step
(``time/rollout`` waiting for groups, ``time/log_probs``, ``time/train``,
``time/rollout_wait``, ``time/sync``) is printed too. The last line printed is the
figures of every loop as JSON.
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
PARTS = ("rollout", "log_probs", "train", "rollout_wait", "sync")


def loop_steps(config, steps: int, warmup: int) -> list[tuple[dict, float]]:
    """(record, reference compute seconds) of ``steps`` steps of ``config.rollout.loop``
    after ``warmup`` steps; each step's reference runs right after it."""
    from rl_launcher.data.buffer import DataBuffer
    from rl_launcher.loops.feeds import make_feed
    from rl_launcher.loops.rl import run_step
    from rl_launcher.session.start import start_run

    config.num_steps = warmup + steps
    run = start_run(config)
    try:
        reference = Reference(config, Path(config.logging.run_dir) / "initial_model")
        buffer = DataBuffer.from_config(config, num_ranks=run.num_ranks)
        feed = make_feed(run, last_step=config.num_steps)
        try:
            pairs = [
                (run_step(run, buffer, step, feed), reference.step())
                for step in range(1, config.num_steps + 1)
            ]
        finally:
            feed.close()
    finally:
        run.close()
    return pairs[warmup:]


class Reference:
    """A step's compute in this process (sample, log-probs, optimizer steps) on a batch
    shaped like the loop's: batch_size prompts x group_size samples of a 4-token prompt
    ("3+4=") and a 1-token answer."""

    def __init__(self, config, model_dir: Path):
        from rl_core.batch import batch_from_samples
        from rl_core.types import Sample
        from rl_fsdp import FSDPBackend
        from rl_launcher.roles.train_group import fsdp_config

        self.num_minibatches = config.algorithm.num_minibatches
        self.backend = FSDPBackend(fsdp_config(config, model_dir=model_dir))
        num = config.rollout.batch_size * config.rollout.group_size
        samples = [Sample(tokens=[5, 11, 4, 14, 8], response_length=1, index=i) for i in range(num)]
        self.batch = batch_from_samples(samples, [float(i % 2) - 0.5 for i in range(num)])

    def step(self) -> float:
        from rl_launcher.loops.step import minibatches
        from rl_launcher.roles.train_group import with_old_log_probs

        start = time.perf_counter()
        with torch.no_grad():  # one forward over the prompts = the engine's sampling compute
            _ = self.backend.compute_log_probs(self.batch)
        old = self.backend.compute_log_probs(self.batch)
        (batch,) = with_old_log_probs([self.batch], [old])
        for part in minibatches([batch], self.num_minibatches):
            self.backend.train_step(part[0])
        return time.perf_counter() - start


def summarize(pairs: list[tuple[dict, float]], config) -> dict:
    records = [record for record, _ in pairs]
    parts = {
        f"{part}_ms": statistics.median(r.get(f"time/{part}", 0.0) for r in records) * 1e3
        for part in PARTS
    }
    return {
        "step_ms": statistics.median(r["time/step"] for r in records) * 1e3,
        "compute_ms": statistics.median(seconds for _, seconds in pairs) * 1e3,
        "overhead_ms": statistics.median(r["time/step"] - s for r, s in pairs) * 1e3,
        "steps": len(records),
        "samples_per_step": config.rollout.batch_size * config.rollout.group_size,
        "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in records),
        "cpu_count": os.cpu_count(),
        "load_1min": os.getloadavg()[0],
    } | parts


def report(loop: str, summary: dict) -> None:
    print(f"[{loop}] {summary['steps']} steps measured (load {summary['load_1min']:.1f})")
    for part in PARTS:
        print(f"  time/{part:<12} median {summary[f'{part}_ms']:7.1f} ms")
    print(f"  loop step         median {summary['step_ms']:7.1f} ms")
    print(f"  compute alone     median {summary['compute_ms']:7.1f} ms (single process)")
    print(f"  overhead (paired) median {summary['overhead_ms']:7.1f} ms (target <= 100 ms)")


def main() -> None:
    from rl_launcher.config.loader import load_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--loops", default="sync,one_step_async,async")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    root, results = Path(tempfile.mkdtemp(prefix="loop_overhead_")), {}
    for loop in args.loops.split(","):
        config, _ = load_config(
            [
                "--config",
                str(CONFIG),
                "--logging.run_dir",
                str(root / loop),
                "--logging.progress",
                "false",
                "--rollout.loop",
                loop,
            ]
        )
        results[loop] = summarize(loop_steps(config, args.steps, args.warmup), config)
        report(loop, results[loop])
    rounded = {loop: {k: round(v, 1) for k, v in s.items()} for loop, s in results.items()}
    print(json.dumps(rounded))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
