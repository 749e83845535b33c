"""The learning curve of a run of config.yaml, from its rollout dumps: per step, the mean
reward, the fraction of episodes with a valid calculator call and with the right answer.

    python examples/agent/curve.py runs/agent/dumps [--every 5]

calculator_agent.py scores 0.2 for a valid call plus 1 for the right answer, so both
fractions are read off the rewards the dumps hold.
"""

import argparse
import json
from pathlib import Path


def step_figures(path: Path) -> dict:
    rewards = [json.loads(line)["reward"] for line in path.read_text().splitlines()]
    valid = [round(r % 1, 3) == 0.2 for r in rewards]  # 0.2 or 1.2
    return {
        "samples": len(rewards),
        "reward": sum(rewards) / len(rewards),
        "valid_calls": sum(valid) / len(rewards),
        "correct": sum(r >= 1 for r in rewards) / len(rewards),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dumps", type=Path)
    parser.add_argument("--every", type=int, default=1, help="average over this many steps")
    args = parser.parse_args()
    steps = [step_figures(p) for p in sorted(args.dumps.glob("rollout_*.jsonl"))]
    print("steps      reward  valid_calls  correct")
    for start in range(0, len(steps), args.every):
        window = steps[start : start + args.every]
        mean = {k: sum(s[k] for s in window) / len(window) for k in window[0]}
        span = f"{start + 1}-{start + len(window)}"
        print(f"{span:9s} {mean['reward']:7.3f} {mean['valid_calls']:12.3f} {mean['correct']:8.3f}")


if __name__ == "__main__":
    main()
