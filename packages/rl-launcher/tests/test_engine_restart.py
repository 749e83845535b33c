"""An engine SIGKILLed between two steps of a real run (Ray, an rl-fsdp training actor, two
embedded engines behind the real sglang-router): the health monitor restarts it with the
trainer's weights (and a frozen garbage collector), the next step still trains on a full
batch, and the weight sync after it reaches both engines."""

import os
import signal

import pytest
from test_train_loop import shrunk

from rl_launcher.config.loader import load_config
from rl_launcher.data.buffer import DataBuffer
from rl_launcher.infra import data_order
from rl_launcher.loops.feeds import SyncFeed
from rl_launcher.loops.rl import run_step
from rl_launcher.session.start import start_run

pytestmark = pytest.mark.integration


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
        metrics = run_step(run, buffer, 2, SyncFeed(run))
        monitor = run.rollout.engines.monitor
        assert [event.url for event in monitor.events] == [victim.url], monitor.errors
        assert run.rollout.engines.weight_versions() == ["2", "2"]  # the sync reached both
        assert metrics["sync/weight_version"] == 2.0
        step_2 = [r for r in data_order.read(config.logging.run_dir) if r["step"] == 2]
        assert len(step_2[0]["prompts"]) == config.rollout.batch_size  # no group lost
        assert metrics["rollout/groups_left_over"] == 0
        assert victim.process.poll() is None  # the restarted engine is alive
    finally:
        run.close()
