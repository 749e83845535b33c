"""Scoring samples with a synchronous reward under a time limit, as the launcher's rollout
does: in reward worker processes (``rl_rewards.pool.RewardPool``, which can kill a hung
call) against the reused daemon threads that ran them before (``rl_sglang.rollout.rewards.
DaemonThreads``, which cannot), each awaited from one event loop, with the process alone and
with another Python thread busy (the driver's main thread while a one-step-async rollout
overlaps training). Rewards: ``exact_match`` (trivial: the round trip is all there is) and
``math`` on symbolic answers that differ per call (sympy-bound, no cache hits: the threads
share one GIL, the processes do not).

    python bench/reward_pool.py [--calls 1024] [--math-calls 128] [--rounds 2] [--workers N]
"""

import argparse
import asyncio
import json
import os
import sys
import time

from busy import busy_thread

from rl_rewards import get_reward
from rl_rewards.pool import RewardPool, default_workers
from rl_sglang.rollout.rewards import DaemonThreads

SAMPLES = {  # call i's (response, label)
    "exact_match": lambda i: ("7", "7"),
    "math": lambda i: (f"so $\\boxed{{\\frac{{x^2-{i * i}}}{{x-{i}}}}}$", f"x+{i}"),
}


def measure(name: str, calls: int, rounds: int, workers: int, busy: bool) -> dict:
    fn, sample = get_reward(name), SAMPLES[name]
    threads = DaemonThreads(name="bench-reward")
    out: dict[str, list[float]] = {"threads": [], "processes": []}
    with RewardPool(name, timeout_s=60, workers=workers) as pool:
        assert pool.submit(*sample(0)).result().value == 1.0  # the processes have loaded it
        fn(*sample(0))

        async def rounds_of_both():
            for number in range(rounds):  # interleaved, so that load changes hit both alike
                batch = [sample(1 + number * calls + i) for i in range(calls)]  # none cached
                start = time.perf_counter()
                await asyncio.gather(*(threads.submit(fn, *args) for args in batch))
                out["threads"].append(time.perf_counter() - start)
                start = time.perf_counter()
                results = await asyncio.gather(*(pool.score(*args) for args in batch))
                out["processes"].append(time.perf_counter() - start)
                assert all(r.value == 1.0 for r in results)

        with busy_thread(busy):
            asyncio.run(rounds_of_both())
    best = {key: min(values) for key, values in out.items()}
    return out | {"ratio_threads_over_processes": best["threads"] / best["processes"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1024)
    parser.add_argument("--math-calls", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=default_workers())
    args = parser.parse_args()
    report = {
        "calls": args.calls,
        "math_calls": args.math_calls,
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "command": " ".join(sys.argv),
    }
    for name in SAMPLES:
        for busy in (False, True):
            key = f"{name}/{'another_thread_busy' if busy else 'alone'}"
            calls = args.math_calls if name == "math" else args.calls
            report[key] = measure(name, calls, args.rounds, args.workers, busy)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
