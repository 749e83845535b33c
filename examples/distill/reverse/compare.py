"""GRPO alone, GRPO + on-policy distillation (raw, as slime's --use-opd, and whitened, as
with --normalize-advantages) and distillation alone (--arms opd) on the reversal task,
seeds interleaved (seed 1 of every arm, then seed 2, ...), the same step budget each.

    nice -n 10 uv run --package rl-launcher python examples/distill/reverse/compare.py

Needs the teacher and the student's warm-up (teacher.yaml, student_sft.yaml). Each run's
directory is runs/distill/reverse/<arm>_s<seed>; a run whose last step is logged is not run
again. The reward of a step is the mean exact match of its 256 samples, read from the
rollout dumps (the distillation-only arm trains on a zero reward, rewards.py); the final
checkpoint is also graded on all 1000 prompts by evaluate.py. Prints a Markdown table and
writes runs/distill/reverse/compare.json.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
RUNS = ROOT / "runs/distill/reverse"
sys.path.insert(0, str(HERE))

from evaluate import report  # noqa: E402

ARMS = {
    "grpo": ["distill.coef=0", "distill.teacher_path=null"],
    "grpo_opd": [],  # distill.coef 1, as slime's --use-opd with its defaults
    "grpo_opd_norm": ["algorithm.normalize_advantages=true"],  # and --normalize-advantages
    "opd": ["rollout.reward=rewards:exact_match_unused", "algorithm.reward_key=none"],
}


def train(arm: str, seed: int, num_steps: int) -> tuple[Path, float]:
    """Runs one arm (unless done already); its run directory and wall seconds."""
    run_dir = RUNS / f"{arm}_s{seed}"
    if len(step_rewards(run_dir)) == num_steps:
        return run_dir, float("nan")
    overrides = [
        f"seed={seed}",
        f"num_steps={num_steps}",
        f"checkpoint.interval={num_steps}",
        f"logging.run_dir={run_dir}",
        f"rollout.dump_dir={run_dir / 'dumps'}",
        *ARMS[arm],
    ]
    env = os.environ | {"PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = ["rl-train", "--config", str(HERE / "student.yaml"), *overrides]
    start = time.monotonic()
    with (RUNS / f"{arm}_s{seed}.log").open("w") as log:
        subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=log, check=True)
    return run_dir, time.monotonic() - start


def step_rewards(run_dir: Path) -> list[float]:
    """Each step's mean exact match over its samples, from the rollout dumps."""
    from rl_launcher.infra.dumps import dump_files, read_rollout

    means = []
    for path in dump_files(run_dir / "dumps"):
        rewards = [exact(s.reward) for group in read_rollout(path) for s in group]
        means.append(sum(rewards) / len(rewards))
    return means


def digit_accuracy(run_dir: Path, step: int) -> float:
    """The fraction of answer digits right (each in its place) in the step's samples: the
    per-token progress that exact match does not see."""
    from rl_launcher.infra.dumps import dump_files, read_rollout

    right = total = 0
    for group in read_rollout(dump_files(run_dir / "dumps")[step - 1]):
        for sample in group:
            prompt = sample.tokens[: len(sample.tokens) - sample.response_length]
            digits, response = prompt[-4:-1], sample.tokens[len(prompt) :]  # before "="
            total += 3
            right += sum(j < len(response) and response[j] == digits[2 - j] for j in range(3))
    return right / total


def exact(reward) -> float:
    return reward["exact_match"] if isinstance(reward, dict) else reward


def steps_to(rewards: list[float], threshold: float, window: int = 5) -> int | None:
    """The first step whose trailing ``window``-step mean reward reaches ``threshold``."""
    for end in range(window, len(rewards) + 1):
        if sum(rewards[end - window : end]) / window >= threshold:
            return end
    return None


def summary(arm: str, seed: int, run_dir: Path, wall_s: float, args) -> dict:
    from rl_launcher.infra.run_log import read_metrics

    rewards = step_rewards(run_dir)
    records = read_metrics(run_dir)
    kl = [r["opd/reverse_kl"] for r in records if "opd/reverse_kl" in r]
    step_s = sorted(r["time/step"] for r in records if "time/step" in r)
    late = rewards[args.late_from - 1 :]
    final = report(str(run_dir / f"checkpoints/step_{args.num_steps:06d}/hf"))
    return {
        "arm": arm,
        "seed": seed,
        "rewards": rewards,
        "digit_accuracy_first_last": [
            digit_accuracy(run_dir, 1),
            digit_accuracy(run_dir, len(rewards)),
        ],
        "late_mean": sum(late) / len(late),
        "steps_to": {str(t): steps_to(rewards, t) for t in args.thresholds},
        "reverse_kl_first_last": [kl[0], kl[-1]] if kl else None,
        "final": final,
        "wall_s": wall_s,  # nan: trained by an earlier invocation
        "median_step_s": step_s[len(step_s) // 2],
    }


def table(rows: list[dict], args) -> str:
    marks = [m for m in (1, 10, 20, 30, 40) if m <= args.num_steps]
    head = (
        ["arm", "seed", *(f"@{m}" for m in marks), f"mean {args.late_from}-{args.num_steps}"]
        + [f"5-step mean >= {t}" for t in args.thresholds]
        + ["digits right first -> last", "final p_exact", "final greedy"]
        + ["reverse KL first -> last", "s/step (median)"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        kl = row["reverse_kl_first_last"]
        cells = [row["arm"], str(row["seed"])]
        cells += [f"{row['rewards'][m - 1]:.3f}" for m in marks]
        cells += [f"{row['late_mean']:.3f}"]
        cells += [str(row["steps_to"][str(t)] or "not reached") for t in args.thresholds]
        digits = row["digit_accuracy_first_last"]
        cells += [f"{digits[0]:.2f} -> {digits[1]:.2f}"]
        cells += [f"{row['final']['p_exact']:.3f}", f"{row['final']['greedy']:.3f}"]
        cells += [f"{kl[0]:.2f} -> {kl[1]:.2f}" if kl else "-", f"{row['median_step_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def means(rows: list[dict], args) -> str:
    """Per arm, the mean over seeds of the late reward and of the final grades."""
    lines = ["| arm | seeds | mean reward, late steps | final p_exact | final greedy |"]
    lines.append("|---|---|---|---|---|")
    for arm in args.arms:
        mine = [row for row in rows if row["arm"] == arm]
        if not mine:
            continue
        late = sum(r["late_mean"] for r in mine) / len(mine)
        p_exact = sum(r["final"]["p_exact"] for r in mine) / len(mine)
        greedy = sum(r["final"]["greedy"] for r in mine) / len(mine)
        seeds = ", ".join(str(r["seed"]) for r in mine)
        lines.append(f"| {arm} | {seeds} | {late:.3f} | {p_exact:.3f} | {greedy:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument(
        "--arms", nargs="+", default=["grpo", "grpo_opd", "grpo_opd_norm"], choices=list(ARMS)
    )
    parser.add_argument("--num_steps", type=int, default=30)
    parser.add_argument("--late_from", type=int, default=21)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.25, 0.5])
    args = parser.parse_args()
    RUNS.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        for arm in args.arms:
            run_dir, wall_s = train(arm, seed, args.num_steps)
            rows.append(summary(arm, seed, run_dir, wall_s, args))
            print(table(rows[-1:], args), flush=True)
    (RUNS / "compare.json").write_text(json.dumps(rows, indent=1))
    by_arm = sorted(rows, key=lambda row: args.arms.index(row["arm"]))
    print(table(by_arm, args))
    print(means(rows, args))


if __name__ == "__main__":
    main()
