"""An engine SIGKILLed between two steps of a real run (Ray, an rl-fsdp training actor with
rank-8 LoRA adapters synced alone, two embedded engines behind the real sglang-router): the
health monitor restarts it, gives it the adapter of the current version under the name the
other engine serves (it scores a sequence as that engine does) and a frozen garbage
collector; the next step still trains on a full batch, and the sync after it reaches both
engines."""

import asyncio
import os
import signal
import time

import pytest
from test_train_loop import shrunk

from rl_launcher.config.loader import load_config
from rl_launcher.data.buffer import DataBuffer
from rl_launcher.infra import data_order
from rl_launcher.loops.feeds import SyncFeed
from rl_launcher.loops.rl import run_step
from rl_launcher.session.start import start_run

pytestmark = pytest.mark.integration
RESTORE_WAIT_S = 120.0
PROBE_IDS = [3, 11, 5, 14, 7, 2, 9, 12]  # teacher-forced: any ids of the quickstart's 16


def restored_within(monitor, timeout_s: float) -> None:
    """Until the monitor has restarted and restored an engine (or given up on one)."""
    deadline = time.monotonic() + timeout_s
    while not (monitor.events or monitor.errors) and time.monotonic() < deadline:
        time.sleep(0.2)


async def scores(url: str, adapter: str | None) -> list[float]:
    from rl_sglang.client import EngineClient

    async with EngineClient(url, lora_path=adapter) as client:
        return await client.prompt_logprobs(PROBE_IDS)


async def weight_version(url: str) -> str:
    from rl_sglang.client import EngineClient

    async with EngineClient(url) as client:
        return await client.weight_version()


def test_killed_engine_is_restarted_and_the_run_goes_on(tmp_path):
    extra = (
        "--engine.num_engines",
        "2",
        "--cluster.devices_per_node",
        "2",
        "--backend.num_ranks",
        "1",
        "--engine.health_interval_s",
        "0.5",
        "--checkpoint.interval",
        "0",
        "--model.lora_rank",
        "8",  # model.lora_sync: adapter, the default
    )
    config, _ = load_config(shrunk(tmp_path / "run", *extra))
    run = start_run(config)
    try:
        buffer = DataBuffer.from_config(config, num_ranks=run.num_ranks)
        run_step(run, buffer, 1, SyncFeed(run))
        frozen = run.rollout.engines.freeze_gc()  # what the loop does after its first step
        assert len(frozen) == 2 and all(a.startswith("Garbage collection frozen") for a in frozen)
        victim = run.rollout.engines.servers[1]
        os.kill(victim.process.pid, signal.SIGKILL)
        monitor = run.rollout.engines.monitor
        restored_within(monitor, RESTORE_WAIT_S)
        assert [event.url for event in monitor.events] == [victim.url], monitor.errors
        # the restarted engine serves policy_v1 as the other engine does, not its base
        other = run.rollout.engines.servers[0]
        assert asyncio.run(weight_version(victim.url)) == "1"
        adapted = asyncio.run(scores(victim.url, "policy_v1"))
        assert adapted == pytest.approx(asyncio.run(scores(other.url, "policy_v1")), abs=1e-5)
        assert adapted != pytest.approx(asyncio.run(scores(victim.url, None)), abs=1e-4)
        metrics = run_step(run, buffer, 2, SyncFeed(run))
        assert run.rollout.engines.weight_versions() == ["2", "2"]  # the sync reached both
        assert metrics["sync/weight_version"] == 2.0
        step_2 = [r for r in data_order.read(config.logging.run_dir) if r["step"] == 2]
        assert len(step_2[0]["prompts"]) == config.rollout.batch_size  # no group lost
        assert metrics["rollout/groups_left_over"] == 0
        assert victim.process.poll() is None  # the restarted engine is alive
    finally:
        run.close()
