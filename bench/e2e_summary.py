"""Summarise rl-train run directories (their ``metrics.jsonl``) into one JSON object:
reward curve, steady-state time split (median over the steps after ``--skip`` warm-up
steps), overhead share, in-loop training throughput and GPU utilisation per run.

    python bench/e2e_summary.py runs/a runs/b --skip 3 > summary.json

With ``--pair ASYNC SYNC`` (two run names) it adds the one-step-async check of issue 8:
the async run's step time against max(the sync run's rollout time, its
log-prob + train + sync time).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from rl_launcher.infra.run_log import read_metrics

PARTS = (
    "step",
    "rollout",
    "log_probs",
    "train",
    "sync",
    "rollout_wait",
    "overhead",
    "overhead_excl_sync",
    "log_probs_compute",
    "train_compute",
    "onload",
    "train_call",
    "train_dispatch",
    "train_return",
    "turns",
    "turns/in_rollout",
    "turns/engine_release",
    "turns/engine_resume",
    "turns/trainer_offload",
    "turns/trainer_onload",
    "turns/trainer_empty_cache",
    "sync_call",
    "sync_export",
    "gc",
    "gc_max",
    "trainer_gc",
)
PERF = (
    "perf/train_tokens_per_s",
    "perf/train_tokens_per_s_wall",
    "perf/mfu",
    "time/overhead_frac",
    "time/overhead_excl_sync_frac",
    "mismatch/logprob_abs_diff_mean",
    "sync/bytes",
)


def median_of(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), int | float)]
    return statistics.median(values) if values else None


def reward_curve(records: list[dict], window: int = 5) -> dict:
    rewards = [r.get("rollout/reward/mean") for r in records]
    rewards = [x for x in rewards if isinstance(x, int | float)]
    if not rewards:
        return {}
    means = [statistics.fmean(rewards[i : i + window]) for i in range(len(rewards) - window + 1)]
    return {
        "first": statistics.fmean(rewards[:window]),
        "last": statistics.fmean(rewards[-window:]),
        "best_moving_mean": max(means, default=rewards[-1]),
        "window": window,
        "per_step": [round(x, 4) for x in rewards],
    }


def summarise(run_dir: Path, skip: int) -> dict:
    records = read_metrics(run_dir)  # a torn last line (a killed run) is skipped
    steady = records[skip:] or records
    gpu_keys = sorted({k for r in steady for k in r if k.startswith("gpu/")})
    return {
        "steps": len(records),
        "steady_steps": len(steady),
        "reward": reward_curve(records),
        "time_median_s": {p: median_of(steady, f"time/{p}") for p in PARTS},
        "perf_median": {k: median_of(steady, k) for k in PERF},
        "gpu_median": {k: median_of(steady, k) for k in gpu_keys},
        "total_time_s": sum(r.get("time/step", 0.0) for r in records),
    }


def async_check(runs: dict, async_name: str, sync_name: str) -> dict:
    sync_t, async_t = runs[sync_name]["time_median_s"], runs[async_name]["time_median_s"]
    training = sum(sync_t[p] or 0.0 for p in ("log_probs", "train", "sync"))
    bound = max(sync_t["rollout"] or 0.0, training)
    return {
        "async_step_s": async_t["step"],
        "sync_step_s": sync_t["step"],
        "sync_rollout_s": sync_t["rollout"],
        "sync_training_s": training,
        "async_over_max": async_t["step"] / bound,
        "target": 1.1,
        "speedup": sync_t["step"] / async_t["step"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of medians")
    parser.add_argument("--pair", nargs=2, metavar=("ASYNC", "SYNC"))
    args = parser.parse_args(argv)
    runs = {}
    for run_dir in args.run_dirs:
        if not (run_dir / "metrics.jsonl").exists():
            print(f"e2e_summary: {run_dir} has no metrics.jsonl; left out", file=sys.stderr)
            continue
        runs[run_dir.name] = summarise(run_dir, args.skip)
    out = {"runs": runs}
    if args.pair and all(name in runs for name in args.pair):
        out["one_step_async"] = async_check(runs, *args.pair)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
