"""Engines that die during a run are restarted, not fatal. rl-sglang's
:class:`~rl_sglang.health.HealthMonitor` checks every engine each
``engine.health_interval_s`` seconds; a dead one is taken out of the router, restarted on
its port, given the trainer's current weights (an HF export on disk, loaded with
``/update_weights_from_disk`` at the run's weight version) and only then put back.
Requests that hit it meanwhile are retried by the rollout on the other engines, and a
weight sync waits until the restart is over (:func:`wait_for_restarts`).

With ``distributed`` weight sync a restarted engine would be outside the trainer's
weight-update group, and colocated on GPUs it would come back holding all its memory while
the others have released theirs for training (SGLang then rejects the next resume and
exits): in both cases the monitor is off, and a dead engine stops the run at its next
request, naming it.
"""

import asyncio
import sys
from pathlib import Path

RESTART_WAIT_S = 600.0


def watch_engines(run) -> None:
    """Start the health monitor of ``run``'s engines (when configured and possible)."""
    engine = run.config.engine
    if engine.health_interval_s <= 0:
        return
    if run.sync_options.get("transport") == "distributed":
        print(
            "rl-train: engine health checks are off with distributed weight sync (a "
            "restarted engine cannot rejoin the weight-update group)",
            file=sys.stderr,
        )
        return
    if run.rollout.turns is not None:
        print(
            "rl-train: engine health checks are off while engines take turns with "
            "training on the same GPUs (a restarted engine would not know the turn)",
            file=sys.stderr,
        )
        return
    from rl_sglang.health import HealthMonitor

    run.rollout.monitor = HealthMonitor(
        run.rollout.engines,
        router=run.rollout.router,
        restore=lambda e: restore(run, e),
        interval_s=engine.health_interval_s,
        timeout_s=engine.health_timeout_s,
        failures_to_restart=3,
        max_restarts=engine.max_restarts,
    ).start()


def restore(run, engine) -> None:
    """Give a restarted ``engine`` the trainer's weights and the run's weight version."""
    from rl_launcher.roles.rollout_manager import freeze_gc
    from rl_sglang.client import EngineClient

    if run.trainer is None:  # rollout-only: never synced, the start-up weights are current
        return
    path = Path(run.config.logging.run_dir) / "restore_weights"
    run.trainer.export_hf(str(path))
    version = str(run.weight_version)

    async def load() -> str | None:
        async with EngineClient(engine.url, api_key=engine.api_key) as client:
            await client.update_weights_from_disk(str(path), weight_version=version)
            if run.config.engine.freeze_gc:  # as the loop did for the engines after step 1
                return await freeze_gc(client)
        return None

    if frozen := asyncio.run(load()):
        print(f"rl-train: engine {engine.url}: {frozen}", file=sys.stderr, flush=True)
    print(
        f"rl-train: engine {engine.url} restarted with the weights of version {version}",
        file=sys.stderr,
        flush=True,
    )


def wait_for_restarts(run) -> None:
    """Before weights go to every engine: an engine that died and was not restarted yet
    (the monitor sees it at its next round) is waited for, then any restart in progress."""
    import time

    monitor = run.rollout.monitor
    if monitor is None:  # no engines (a replay), or health checks off
        return
    deadline = time.monotonic() + RESTART_WAIT_S
    while any(not engine.alive() for engine in monitor.engines) or not monitor.wait_idle(0.2):
        if time.monotonic() > deadline:
            raise RuntimeError(f"engines not back after {RESTART_WAIT_S:.0f} s: {monitor.errors}")
        time.sleep(0.2)
