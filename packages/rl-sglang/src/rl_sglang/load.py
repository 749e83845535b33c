"""Load driver: many concurrent ``/generate`` requests against one URL (usually the router),
with bounded concurrency; every request ends as completed or as failed with its status.

    report = asyncio.run(run_load(router.url, num_requests=4000, concurrency=256))
    report["completed"], report["failed"], report["latency_ms"]["p99"], report["requests_per_s"]
    peak_rss_mb({"router": router.process.pid})   # high-water resident memory per process

``bench/load.py`` starts the engines and the router around it and records the figures.
"""

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import aiohttp

QUANTILES = (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))


async def _one(session, url: str, body: dict, timeout_s: float) -> tuple[str, float, int]:
    """(status, seconds, output tokens): "200", "HTTP 5xx", or the exception's name."""
    started = time.perf_counter()
    try:
        async with session.post(
            url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            data = await r.json(content_type=None) if r.status == 200 else await r.text()
            status = "200" if r.status == 200 else f"HTTP {r.status}"
    except (aiohttp.ClientError, TimeoutError) as error:
        return type(error).__name__, time.perf_counter() - started, 0
    tokens = len(data.get("output_ids", ())) if isinstance(data, dict) else 0
    return status, time.perf_counter() - started, tokens


def _bodies(num_requests: int, prompt_len: int, max_new_tokens: int, vocab: int, seed: int):
    rng = random.Random(seed)
    params = {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 1.0}
    for index in range(num_requests):
        ids = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        yield {"input_ids": ids, "sampling_params": params, "rid": f"load-{seed}-{index}"}


async def run_load(
    url: str,
    *,
    num_requests: int,
    concurrency: int,
    max_new_tokens: int = 8,
    prompt_len: int = 8,
    vocab: int = 256,
    timeout_s: float = 300.0,
    seed: int = 0,
    api_key: str | None = None,
) -> dict:
    """Send ``num_requests`` /generate calls, at most ``concurrency`` at a time."""
    if num_requests < 1 or concurrency < 1:
        raise ValueError("num_requests and concurrency must be >= 1")
    semaphore = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=concurrency)

    async def bounded(session, body):
        async with semaphore:
            return await _one(session, url.rstrip("/") + "/generate", body, timeout_s)

    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        bodies = _bodies(num_requests, prompt_len, max_new_tokens, vocab, seed)
        outcomes = await asyncio.gather(*(bounded(session, b) for b in bodies))
    return summarize(outcomes, time.perf_counter() - started, concurrency)


def summarize(outcomes: list[tuple[str, float, int]], wall_s: float, concurrency: int) -> dict:
    statuses = Counter(status for status, _, _ in outcomes)
    latencies = sorted(seconds for status, seconds, _ in outcomes if status == "200")
    tokens = sum(count for _, _, count in outcomes)
    return {
        "requests": len(outcomes),
        "concurrency": concurrency,
        "completed": statuses.get("200", 0),
        "failed": len(outcomes) - statuses.get("200", 0),
        "statuses": dict(statuses),
        "latency_ms": {q: round(1000 * percentile(latencies, p), 2) for q, p in QUANTILES},
        "wall_s": round(wall_s, 3),
        "requests_per_s": round(len(latencies) / wall_s, 2),
        "output_tokens_per_s": round(tokens / wall_s, 1),
    }


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending list (nan when empty)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, -(-len(sorted_values) * pct // 100))
    return sorted_values[int(rank) - 1]


def peak_rss_mb(pids: dict[str, int], *, descendants: bool = True) -> dict[str, float]:
    """Peak resident memory (VmHWM, MiB, from /proc on Linux) of each named process, plus
    with ``descendants`` the peaks of its children's trees (summed: an upper bound if they
    peaked at different times)."""
    return {name: round(_hwm_kb(pid, descendants) / 1024, 1) for name, pid in pids.items()}


def _hwm_kb(pid: int, descendants: bool) -> int:
    total = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            total += int(line.split()[1])
    for child in _children(pid) if descendants else ():
        total += _hwm_kb(child, descendants)
    return total


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []
