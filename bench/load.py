"""Load test: thousands of concurrent /generate requests through the real sglang-router to
two embedded engines serving a tiny model, all on loopback.

    .tox/sglang/bin/python bench/load.py [--requests 4000] [--concurrency 256]
        [--max-new-tokens 8] [--no-baseline] [--kill-engine-after S] [--json out.json]

Every request completes or fails with its status (HTTP code or exception); the figures are
p50/p99 latency, throughput and the peak resident memory (VmHWM) of each process. The
baseline, measured in the same run, sends the same requests straight to the two engines
(split evenly, no router): ratio = router throughput / direct throughput. With
``--kill-engine-after S`` engine 1 is SIGKILLed S seconds in, a health monitor restarts it,
and the statuses show what the clients saw. The last line printed is the JSON.
"""

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from rl_sglang.health import HealthMonitor
from rl_sglang.load import peak_rss_mb, run_load
from rl_sglang.process import EmbeddedEngine
from rl_sglang.router import Router
from rl_sglang.tiny import save_tiny_model


async def direct_load(urls: list[str], **kwargs) -> dict:
    """The baseline: the requests split over the engines by the client, no router."""
    share = -(-kwargs.pop("num_requests") // len(urls))
    concurrency = kwargs.pop("concurrency")
    started = time.perf_counter()
    parts = await asyncio.gather(
        *(
            run_load(
                url,
                num_requests=share,
                concurrency=max(1, concurrency // len(urls)),
                seed=index + 1,
                **kwargs,
            )
            for index, url in enumerate(urls)
        )
    )
    wall = time.perf_counter() - started
    completed = sum(p["completed"] for p in parts)
    return {
        "requests": sum(p["requests"] for p in parts),
        "completed": completed,
        "failed": sum(p["failed"] for p in parts),
        "requests_per_s": round(completed / wall, 2),
        "latency_ms_p50_by_engine": [p["latency_ms"]["p50"] for p in parts],
    }


def routed_load(router, engines, load: dict, kill_after_s: float | None) -> dict:
    """The load through the router; with ``kill_after_s``, engine 1 is SIGKILLed that long
    into the run while a health monitor watches (its restart is reported)."""
    if kill_after_s is None:
        return asyncio.run(run_load(router.url, **load))
    monitor = HealthMonitor(engines, router=router, interval_s=0.5, timeout_s=2.0).start()

    async def with_kill():
        task = asyncio.ensure_future(run_load(router.url, **load))
        await asyncio.sleep(kill_after_s)
        await asyncio.to_thread(engines[1].kill)
        killed_at = time.monotonic()
        return await task, killed_at

    result, killed_at = asyncio.run(with_kill())
    deadline = time.monotonic() + 300
    while not (monitor.events or monitor.errors) and time.monotonic() < deadline:
        time.sleep(0.2)
    monitor.stop()
    result["kill"] = {
        "after_s": kill_after_s,
        "errors": monitor.errors,
        "restarts": [
            {
                "reason": e.reason,
                "detected_after_kill_s": round(e.detected_at - killed_at, 3),
                "restart_s": round(e.restart_s, 2),
                "back_in_router_after_s": round(e.total_s, 2),
            }
            for e in monitor.events
        ],
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--max-batch-size", type=int, default=64, help="per engine")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument(
        "--kill-engine-after",
        type=float,
        default=None,
        help="SIGKILL engine 1 this many seconds into the load (health monitor on)",
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    load = {
        "num_requests": args.requests,
        "concurrency": args.concurrency,
        "max_new_tokens": args.max_new_tokens,
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(Path(tmp) / "tiny", seed=0)
        engines = [
            EmbeddedEngine(model, log_dir=tmp, max_batch_size=args.max_batch_size) for _ in range(2)
        ]
        try:
            for engine in engines:
                engine.start(wait=False)
            for engine in engines:
                engine.wait_ready(timeout_s=600)
            with Router([e.url for e in engines], log_dir=tmp, ready_timeout_s=300) as router:
                asyncio.run(run_load(router.url, **load | {"num_requests": 64}))  # warm-up
                result = routed_load(router, engines, load, args.kill_engine_after)
                pids = {"router": router.process.pid}
                pids |= {f"engine{i}": e.process.pid for i, e in enumerate(engines)}
                result["peak_rss_mb"] = peak_rss_mb(pids)
                result["peak_rss_mb"] |= peak_rss_mb({"client": os.getpid()}, descendants=False)
            if not args.no_baseline:
                result["baseline_direct"] = asyncio.run(
                    direct_load([e.url for e in engines], **load)
                )
                direct = result["baseline_direct"]["requests_per_s"]
                result["ratio_router_vs_direct"] = round(result["requests_per_s"] / direct, 3)
        finally:
            for engine in engines:
                engine.stop()
    result |= {
        "hardware": {
            "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "command": " ".join(["python", *sys.argv]),
    }
    print(f"{result['completed']}/{result['requests']} completed, statuses {result['statuses']}")
    print(f"latency p50 {result['latency_ms']['p50']} ms, p99 {result['latency_ms']['p99']} ms")
    print(f"throughput {result['requests_per_s']} req/s; peak RSS MiB {result['peak_rss_mb']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
