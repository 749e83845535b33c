"""Faults injected into real processes on loopback: an engine SIGKILLed mid-rollout (the
health monitor restarts it, restores the current weights and re-registers it; the rollout
retries its requests and returns every sample exactly once), and servers that never
become reachable (a timeout naming the endpoint with the log tail, not a hang)."""

import asyncio
import os
import signal
import sys
import time

import pytest

from conftest import run, teacher_forced_logprobs
from rl_core.types import Sample, SampleStatus
from rl_sglang import transports
from rl_sglang.client import EngineClient
from rl_sglang.health import HealthMonitor, LastWeights
from rl_sglang.process import EmbeddedEngine, ServerProcess, free_port, stop_all
from rl_sglang.rollout.default import RolloutConfig, default_rollout
from rl_sglang.rollout.generate import GenerateContext
from rl_sglang.router import Router
from rl_sglang.tiny import random_model, tiny_config

pytestmark = pytest.mark.integration
NUM_GROUPS, GROUP_SIZE, NUM_TOKENS = 8, 4, 48


def _prompts():
    return [Sample(prompt="", tokens=[3 + i, 5, 7], label=i) for i in range(NUM_GROUPS)]


async def _wait_running(url: str, timeout_s: float = 60.0) -> None:
    async with EngineClient(url) as client:
        deadline = time.monotonic() + timeout_s
        while (await client.server_info())["internal_states"][0]["num_running"] < 1:
            assert time.monotonic() < deadline, f"{url} never ran a request"
            await asyncio.sleep(0.02)


async def _rollout_killing(cluster, victim):
    """Start a rollout through the router, SIGKILL ``victim`` once it generates."""
    config = RolloutConfig(
        num_groups=NUM_GROUPS,
        n_samples_per_prompt=GROUP_SIZE,
        sampling_params={"max_new_tokens": NUM_TOKENS, "ignore_eos": True},
        max_retries=8,
        retry_backoff_s=0.5,
    )
    async with EngineClient(cluster.router.url) as client:
        ctx = GenerateContext(client=client)
        task = asyncio.ensure_future(default_rollout(ctx, iter(_prompts()), _reward, config))
        await _wait_running(victim.url)
        await asyncio.to_thread(victim.kill)
        killed_at = time.monotonic()
        return await asyncio.wait_for(task, 240), killed_at


def _reward(sample: Sample) -> float:
    return float(sample.tokens[-1] % 2)


@pytest.fixture
def current_weights(fault_cluster, tmp_path):
    """Both engines on version "7" (weights that differ from the start-up ones)."""
    model = random_model(tiny_config(), seed=77)
    path = tmp_path / "weights-7"

    async def sync(clients):
        return await transports.update_from_disk(
            clients, list(model.state_dict().items()), path, weight_version="7"
        )

    run(_with_clients(fault_cluster.engine_urls, sync))
    weights = LastWeights()
    weights.record(path, "7")
    return model, weights


async def _with_clients(urls, fn):
    clients = [EngineClient(url) for url in urls]
    try:
        return await fn(clients)
    finally:
        for client in clients:
            await client.close()


def test_engine_killed_mid_rollout_loses_and_duplicates_no_sample(fault_cluster, current_weights):
    model, weights = current_weights
    victim = fault_cluster.engines[1]
    monitor = HealthMonitor(
        fault_cluster.engines,
        router=fault_cluster.router,
        restore=weights.restore,
        interval_s=0.5,
        timeout_s=1.0,
    )
    with monitor:
        result, killed_at = run(_rollout_killing(fault_cluster, victim))
        deadline = time.monotonic() + 120
        while not monitor.events and time.monotonic() < deadline:
            time.sleep(0.2)
    # every sample exactly once, complete, from the current weights only
    ids = sorted(s.index for group in result.groups for s in group)
    assert ids == list(range(NUM_GROUPS * GROUP_SIZE)) and not result.leftovers
    for sample in (s for group in result.groups for s in group):
        assert sample.status is SampleStatus.TRUNCATED and sample.response_length == NUM_TOKENS
        assert sample.weight_versions == ["7"] and sample.reward == float(sample.tokens[-1] % 2)
    assert result.metrics["rollout/generate_retries"] >= 1  # the victim's requests came back
    # noticed within the bound, restarted, weights restored, routed to again
    assert not monitor.errors and [e.url for e in monitor.events] == [victim.url]
    event = monitor.events[0]
    assert event.reason.startswith("exited")
    assert event.detected_at - killed_at <= monitor.exit_detection_bound_s
    assert victim.url in fault_cluster.router.worker_urls(healthy_only=True)
    prompt = [9, 8, 7]

    async def outputs(clients):
        return [
            await c.generate(
                input_ids=prompt,
                return_logprob=True,
                sampling_params={"max_new_tokens": 6, "ignore_eos": True},
            )
            for c in clients
        ]

    for out in run(_with_clients(fault_cluster.engine_urls, outputs)):
        assert out["meta_info"]["weight_version"] == "7"
        logprobs = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        expected = teacher_forced_logprobs(model, prompt, out["output_ids"], temperature=1.0)
        assert logprobs == pytest.approx(expected, abs=1e-4)


class _StaticHealth(ServerProcess):
    """``python -m http.server`` over a directory holding a file named ``health``: a
    server whose GET /health answers 200, started in a fraction of a second."""

    name = "static"

    def command(self):
        (self.log_dir / "www").mkdir(exist_ok=True)
        (self.log_dir / "www" / "health").write_text("")
        return [
            sys.executable,
            "-m",
            "http.server",
            str(self.port),
            "--bind",
            self.host,
            "--directory",
            str(self.log_dir / "www"),
        ]


def test_health_monitor_restarts_a_hung_server_after_failed_checks(tmp_path):
    """SIGSTOP: the process lives but answers nothing; declared dead after 2 checks."""
    server = _StaticHealth(log_dir=tmp_path).start()
    restored = []
    monitor = HealthMonitor([server], restore=restored.append, interval_s=0.3, timeout_s=0.5)
    try:
        with monitor:
            first_pid = server.process.pid
            os.killpg(first_pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            while not monitor.events and time.monotonic() < stopped_at + 30:
                time.sleep(0.05)
    finally:
        server.stop()
    assert [e.reason for e in monitor.events] == ["2 failed health checks"]
    assert monitor.events[0].detected_at - stopped_at <= monitor.detection_bound_s + 0.3
    assert restored == [server] and server.process.pid != first_pid


def test_health_monitor_gives_up_after_max_restarts(tmp_path):
    server = _StaticHealth(log_dir=tmp_path)
    server.command = lambda: [sys.executable, "-c", "raise SystemExit(3)"]  # dies at start
    server.start(wait=False)
    with HealthMonitor([server], interval_s=0.1, max_restarts=0) as monitor:
        deadline = time.monotonic() + 10
        while not monitor.errors and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "exited (code 3)" in monitor.errors[0] and "giving up" in monitor.errors[0]
    assert monitor.engines == []  # no longer watched, never silently retried for ever


class _Silent(EmbeddedEngine):
    """A process that logs a line and never listens: a server stuck at start-up."""

    def command(self):
        code = "import time; print('loading weights from /nowhere', flush=True); time.sleep(600)"
        return [sys.executable, "-c", code]


def test_engine_never_ready_times_out_with_endpoint_and_log_tail(tmp_path):
    engine = _Silent(tmp_path, log_dir=tmp_path, ready_timeout_s=2)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        engine.start()
    engine.stop()
    message = str(info.value)
    assert time.monotonic() - started < 10 and not engine.alive()
    assert f"{engine.url}/health did not answer 200 within 2s" in message
    assert "loading weights from /nowhere" in message  # the last log lines


def test_router_with_an_unreachable_worker_times_out_naming_it(tmp_path):
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = Router([dead_url], log_dir=tmp_path, ready_timeout_s=4)
    started = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        router.start()
    router.stop()
    assert time.monotonic() - started < 30
    assert dead_url in str(info.value) and "last" in str(info.value)


def test_client_to_an_unreachable_engine_fails_fast_with_the_url():
    url = f"http://127.0.0.1:{free_port()}"

    async def go():
        async with EngineClient(url, retries=2, backoff_s=0.05) as client:
            assert not await client.health()
            await client.generate(input_ids=[1], sampling_params={"max_new_tokens": 1})

    started = time.monotonic()
    with pytest.raises(Exception, match=r"127\.0\.0\.1") as info:
        run(go())
    assert time.monotonic() - started < 5 and "Connect" in type(info.value).__name__


def test_retries_exhausted_groups_come_back_as_leftovers_with_the_error():
    """No engine at all: every request fails, is retried, and its group is handed back
    (for the next rollout) with the error; none vanish, nothing hangs."""
    url = f"http://127.0.0.1:{free_port()}"
    config = RolloutConfig(
        num_groups=3, n_samples_per_prompt=2, max_retries=2, retry_backoff_s=0.01
    )

    async def go():
        async with EngineClient(url) as client:
            ctx = GenerateContext(client=client)
            return await default_rollout(ctx, iter(_prompts()[:3]), _reward, config)

    result = run(go())
    assert result.groups == [] and result.metrics["rollout/generate_retries"] == 3 * 2
    leftovers = [s for group in result.leftovers for s in group]
    assert sorted(s.index for s in leftovers) == list(range(6))
    assert all(s.status is SampleStatus.PENDING and s.response_length == 0 for s in leftovers)
    assert all("ClientConnectorError" in s.metadata["error"] for s in leftovers)


def test_stopping_the_monitor_does_not_wait_for_a_health_check_in_flight(tmp_path):
    """A hung server's /health holds the monitor's check for ``timeout_s``; stop() returns
    before that, and the check's failure restarts nothing afterwards."""
    server = _StaticHealth(log_dir=tmp_path).start()
    monitor = HealthMonitor([server], interval_s=0.05, timeout_s=3.0, failures_to_restart=1)
    try:
        os.killpg(server.process.pid, signal.SIGSTOP)
        monitor.start()
        time.sleep(0.5)  # the first check is waiting on the stopped server
        asked = time.monotonic()
        monitor.stop()
        assert time.monotonic() - asked < 2.0  # not the check's 3 s
        time.sleep(3.5)  # the check fails meanwhile: past stop(), no restart
        assert monitor.events == [] and monitor.errors == []
    finally:
        os.killpg(server.process.pid, signal.SIGCONT)
        server.stop()


class _SlowToStop(_StaticHealth):
    """Takes 0.5 s to exit on SIGTERM, writing when it got the signal and when it left."""

    def command(self):
        code = (
            "import signal, sys, time\n"
            "def leave(*_):\n"
            "    print('term', time.time(), flush=True); time.sleep(0.5)\n"
            "    print('exit', time.time(), flush=True); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, leave)\n"
            "print('up', flush=True)\n"
            "while True: time.sleep(1)\n"
        )
        return [sys.executable, "-c", code]


def test_stop_all_signals_every_server_before_waiting_for_any(tmp_path):
    servers = [_SlowToStop(log_dir=tmp_path).start(wait=False) for _ in range(2)]
    deadline = time.monotonic() + 30
    for server in servers:  # each has its SIGTERM handler before it is stopped
        while "up" not in (server.log_path.read_text() if server.log_path.exists() else ""):
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.05)
    stop_all(servers)
    stamps = [
        dict(line.split() for line in s.log_path.read_text().splitlines()[1:]) for s in servers
    ]
    assert all(not s.alive() for s in servers)
    assert max(float(s["term"]) for s in stamps) < min(float(s["exit"]) for s in stamps)


def test_stop_all_lets_servers_running_elsewhere_stop_themselves(tmp_path):
    class PlacedElsewhere:  # an engine a Ray actor runs on its node: no process here
        stopped = False

        def stop(self):
            self.stopped = True

    placed, here = PlacedElsewhere(), _SlowToStop(log_dir=tmp_path).start(wait=False)
    stop_all([placed, here])
    assert placed.stopped and not here.alive()
