"""The load driver (reduced size) through the real router to two embedded engines: every
request completes or fails with its status; percentiles and peak memory are reported."""

import pytest

from conftest import run
from rl_sglang.client import EngineClient
from rl_sglang.load import peak_rss_mb, percentile, run_load, summarize
from rl_sglang.process import free_port

NUM_REQUESTS = 300


def _finished(urls) -> list[int]:
    async def go():
        counts = []
        for url in urls:
            async with EngineClient(url) as client:
                counts.append((await client.server_info())["internal_states"][0]["num_finished"])
        return counts

    return run(go())


@pytest.mark.integration
def test_concurrent_load_through_the_router_completes_every_request(fault_cluster):
    before = _finished(fault_cluster.engine_urls)
    report = run(
        run_load(
            fault_cluster.router.url, num_requests=NUM_REQUESTS, concurrency=64, max_new_tokens=4
        )
    )
    served = [a - b for a, b in zip(_finished(fault_cluster.engine_urls), before, strict=True)]
    assert report["statuses"] == {"200": NUM_REQUESTS} and report["failed"] == 0
    assert sum(served) == NUM_REQUESTS and min(served) >= NUM_REQUESTS // 3  # both engines
    latency = report["latency_ms"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"]
    assert report["output_tokens_per_s"] == pytest.approx(4 * report["requests_per_s"], rel=1e-2)
    pids = {"router": fault_cluster.router.process.pid}
    pids |= {f"engine{i}": e.process.pid for i, e in enumerate(fault_cluster.engines)}
    assert all(mb > 10 for mb in peak_rss_mb(pids).values())


@pytest.mark.integration
def test_unreachable_target_fails_every_request_explicitly():
    url = f"http://127.0.0.1:{free_port()}"
    report = run(run_load(url, num_requests=20, concurrency=4, timeout_s=5))
    assert report["failed"] == 20 and report["statuses"] == {"ClientConnectorError": 20}
    assert report["requests_per_s"] == 0


def test_summary_and_percentiles_by_hand():
    outcomes = [("200", s / 1000, 2) for s in (40, 10, 30, 20)] + [("HTTP 503", 0.001, 0)]
    report = summarize(outcomes, wall_s=2.0, concurrency=8)
    assert report["statuses"] == {"200": 4, "HTTP 503": 1} and report["failed"] == 1
    assert report["latency_ms"] == {"p50": 20.0, "p90": 40.0, "p99": 40.0, "max": 40.0}
    assert report["requests_per_s"] == 2.0 and report["output_tokens_per_s"] == 4.0
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0 and percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError, match="concurrency"):
        run(run_load("http://127.0.0.1:1", num_requests=1, concurrency=0))
