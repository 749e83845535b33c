"""Tables and a chart from the SmolLM2 learning runs of ``bench/smollm2_gpu.sh learn|trl``:
rl-train's ``metrics.jsonl`` files and the one of ``bench/trl_grpo.py``.

    python3 bench/learn_summary.py --ours grpo=runs/learn_grpo/metrics.jsonl \
        --trl runs/trl_grpo/metrics.jsonl --gpu grpo=runs/learn_grpo.gpu.csv \
        --gpu trl=runs/trl_grpo.gpu.csv --chart docs/results/2026-11-25-h100-smollm2-learn/learning.png

Wall time is training time with evaluation left out, from the first step's start (the
engine or model start-up before it is not counted for either). For each rl-train run it
prints the held-out greedy@1 / pass@1 / pass@8 before and after, the seconds each run took
to first reach the best greedy@1 that it and TRL both reach (evaluated every 25 steps, so a
run is credited at the eval where it got there), median step seconds, rollout tokens/s
(response tokens over rollout seconds), training tokens/s (prompt + response tokens over
train seconds) and the mean GPU utilisation of ``nvidia-smi`` samples between the run's
first and last step (TRL: while its model was on the GPU).
"""

import argparse
import csv
import json
import statistics
from datetime import datetime
from pathlib import Path

GREEDY, PASS1, PASS8 = "eval/test/greedy@1", "eval/test/pass@1", "eval/test/pass@8"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def ours_curve(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(per-step points, eval points), each with ``wall_s``: cumulative step seconds less
    the step's evaluation."""
    wall, steps, evals = 0.0, [], []
    for record in records:
        if record["step"] > 0:
            wall += record["time/step"] - record.get("time/eval", 0.0)
            steps.append(
                {"step": record["step"], "wall_s": wall, "reward": record["rollout/reward/mean"]}
            )
        if GREEDY in record:
            evals.append({"step": record["step"], "wall_s": wall} | evaluation(record))
    return steps, evals


def trl_curve(records: list[dict]) -> tuple[list[dict], list[dict]]:
    steps = [
        {"step": r["step"], "wall_s": r["wall_s"], "reward": r["reward"]}
        for r in records
        if "reward" in r
    ]
    evals = [
        {"step": r["step"], "wall_s": r["wall_s"]} | evaluation(r) for r in records if GREEDY in r
    ]
    return steps, evals


def evaluation(record: dict) -> dict:
    return {key: record[key] for key in (GREEDY, PASS1, PASS8) if key in record}


def first_reaching(evals: list[dict], accuracy: float) -> dict | None:
    return next((e for e in evals if e[GREEDY] >= accuracy - 1e-9), None)


def throughput(records: list[dict]) -> dict[str, float]:
    """rl-train's median step, rollout and training tokens/s over the steps after the first."""
    steps = [r for r in records if r["step"] > 1]
    rollout = sum(r["rollout/response_length/mean"] * r["rollout/num_samples"] for r in steps)
    rollout_s = sum(r["time/rollout"] for r in steps)
    return {
        "step_s": statistics.median(r["time/step"] - r.get("time/eval", 0) for r in steps),
        "rollout_tok_s": rollout / rollout_s,
        "train_tok_s": statistics.median(r["perf/train_tokens_per_s"] for r in steps),
    }


def trl_throughput(records: list[dict]) -> dict[str, float]:
    steps = [r for r in records if "reward" in r and r["step"] > 1]
    generate_s = sum(r["time/generate"] for r in steps)
    train_s = sum(r["time/step"] - r["time/generate"] for r in steps)
    tokens = steps[-1]["num_tokens"] - steps[0]["num_tokens"]  # prompt + completion, cumulative
    return {
        "step_s": statistics.median(r["time/step"] for r in steps),
        "rollout_tok_s": sum(r["tokens/generated"] for r in steps) / generate_s,
        "train_tok_s": tokens / train_s,
    }


def gpu_utilisation(path: Path, window: tuple[float, float] | None) -> float:
    """Mean utilisation (%) of the samples in ``window`` (epoch seconds), or of those taken
    while more than 1 GiB was in use."""
    values = []
    for stamp, util, memory in csv.reader(Path(path).read_text().splitlines()):
        seconds = datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
        inside = window[0] <= seconds <= window[1] if window else float(memory) > 1024
        if inside:
            values.append(float(util))
    return statistics.mean(values) if values else float("nan")


def training_window(records: list[dict]) -> tuple[float, float]:
    """Epoch seconds of the first step's start and the last step's end (rl-train's
    ``time`` field is when a step's record was written; the machine's clock is UTC)."""
    steps = [r for r in records if r["step"] > 0]
    return steps[0]["time"] - steps[0]["time/step"], steps[-1]["time"]


def chart(curves: dict[str, tuple[list[dict], list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, (steps, evals) in curves.items():
        rewards = [s["reward"] for s in steps]
        smooth = [statistics.mean(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
        left.plot([s["wall_s"] for s in steps], smooth, label=name)
        right.plot([e["wall_s"] for e in evals], [e[GREEDY] for e in evals], marker="o", label=name)
    left.set(
        xlabel="training wall time (s, eval excluded)",
        ylabel="train reward (10-step mean)",
        title="Rollout reward",
    )
    right.set(
        xlabel="training wall time (s, eval excluded)",
        ylabel="held-out greedy@1",
        title="Held-out accuracy (200 problems)",
    )
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def named(pairs: list[str]) -> dict[str, Path]:
    return {name: Path(path) for name, path in (pair.split("=", 1) for pair in pairs)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ours", action="append", required=True, help="name=metrics.jsonl")
    parser.add_argument("--trl", required=True, help="bench/trl_grpo.py's metrics.jsonl")
    parser.add_argument("--gpu", action="append", default=[], help="name=nvidia-smi csv")
    parser.add_argument("--chart", type=Path, help="PNG of reward and accuracy vs wall time")
    args = parser.parse_args(argv)
    gpu = named(args.gpu)
    trl_records = read_jsonl(args.trl)
    trl_steps, trl_evals = trl_curve(trl_records)
    rows, curves = {}, {}
    trl_row = {"evals": trl_evals, **trl_throughput(trl_records)}
    if "trl" in gpu:
        trl_row["gpu_util"] = gpu_utilisation(gpu["trl"], None)
    for name, path in named(args.ours).items():
        records = read_jsonl(path)
        steps, evals = ours_curve(records)
        curves[f"rl-train {name}"] = (steps, evals)
        rows[name] = {"evals": evals, **throughput(records)}
        if name in gpu:
            rows[name]["gpu_util"] = gpu_utilisation(gpu[name], training_window(records))
    curves["TRL GRPOTrainer"] = (trl_steps, trl_evals)
    report = {"trl": summary(trl_row, None), "ours": {}}
    for name, row in rows.items():
        common = min(max(e[GREEDY] for e in row["evals"]), max(e[GREEDY] for e in trl_evals))
        report["ours"][name] = summary(row, common) | {
            "common_greedy@1": common,
            "trl_reached_at": first_reaching(trl_evals, common),
        }
    print(json.dumps(report, indent=1))
    if args.chart:
        chart(curves, args.chart)
    return 0


def summary(row: dict, common: float | None) -> dict:
    evals = row["evals"]
    out = {"before": evals[0], "after": evals[-1], "best_greedy@1": max(e[GREEDY] for e in evals)}
    out |= {k: row[k] for k in ("step_s", "rollout_tok_s", "train_tok_s", "gpu_util") if k in row}
    if common is not None:
        out["reached_at"] = first_reaching(evals, common)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
