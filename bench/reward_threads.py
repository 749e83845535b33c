"""Scoring 1,024 samples with a synchronous reward under a timeout (rl-sglang's RewardGuard
runs such rewards in daemon threads): a new thread per call (rl-sglang before 2026-11-22,
kept here as the baseline) against reused threads (``rollout.rewards.DaemonThreads``), with
the event loop alone in the process and with another Python thread busy, as the driver's
main thread is while a one-step-async rollout overlaps training. Each thread start waits
for the new thread to take the GIL, which a busy thread holds for up to the switch interval.

    python bench/reward_threads.py [--calls 1024] [--rounds 2]
"""

import argparse
import asyncio
import contextlib
import json
import sys
import threading
import time

from busy import busy_thread

from rl_sglang.rollout.rewards import DaemonThreads


def thread_per_call(fn, *args) -> asyncio.Future:
    """The baseline: ``fn(*args)`` in a new daemon thread."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def work():
        try:
            outcome = (fn(*args), None)
        except Exception as error:
            outcome = (None, error)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=work, daemon=True).start()
    return future


def reward(_sample) -> float:
    return 1.0


async def seconds_for(submit, calls: int) -> float:
    start = time.perf_counter()
    await asyncio.gather(*(submit(reward, None) for _ in range(calls)))
    return time.perf_counter() - start


def measure(calls: int, rounds: int, busy: bool) -> dict[str, list[float]]:
    reused = DaemonThreads(name="bench-reward")
    out: dict[str, list[float]] = {"thread_per_call": [], "reused_threads": []}

    async def rounds_of_both():
        for _ in range(rounds):  # interleaved, so that load changes hit both alike
            out["thread_per_call"].append(await seconds_for(thread_per_call, calls))
            out["reused_threads"].append(await seconds_for(reused.submit, calls))

    with busy_thread(busy):
        asyncio.run(rounds_of_both())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    report = {"calls": args.calls, "python": sys.version.split()[0]}
    for busy in (False, True):
        report["another_thread_busy" if busy else "alone"] = measure(args.calls, args.rounds, busy)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
