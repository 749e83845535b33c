"""Engine health monitor: a dead engine is noticed within a bounded time, restarted on its
port, given back the current weights and only then re-registered with the router.

    weights = LastWeights()                  # the trainer calls weights.record(path, version)
    monitor = HealthMonitor(engines, router=router, restore=weights.restore).start()
    ...                                      # rollouts retry requests that hit the dead engine
    monitor.stop(); monitor.events           # one EngineRestart per restart, with timings

Detection bounds: each round first looks for exited processes, then calls every engine's
``/health`` (at most ``timeout_s`` each), then sleeps ``interval_s``. An exited engine is
seen within one round, ``interval_s + N * timeout_s`` for N engines
(:attr:`HealthMonitor.exit_detection_bound_s`); one that runs but stops answering is
declared dead after ``failures_to_restart`` failed checks in a row, within
``failures_to_restart`` rounds (:attr:`HealthMonitor.detection_bound_s`).
The router is told first (the worker is removed, so no new request reaches it), and the
restarted engine is added back only after ``restore`` ran: nothing is generated with stale
weights.
"""

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rl_sglang.process import ServerProcess, http_ok

log = logging.getLogger(__name__)
RestoreFn = Callable[[ServerProcess], None]


@dataclass(frozen=True)
class EngineRestart:
    """One restart: ``reason`` is "exited (code N)" or "N failed health checks"; times are
    seconds from the death being noticed to the engine being routed to again."""

    url: str
    reason: str
    detected_at: float  # time.monotonic() when the monitor declared it dead
    restart_s: float  # process start until /health answered
    restore_s: float  # the restore callback (weights)
    total_s: float  # detected -> back in the router


class LastWeights:
    """The last weights synced to disk (a safetensors directory and its version); on
    restart the engine loads them with ``/update_weights_from_disk``. Colocated or
    distributed syncs pass their own ``restore`` callback instead (e.g. a re-sync)."""

    def __init__(self):
        self.path: str | None = None
        self.version: str | None = None

    def record(self, path: str, version: str) -> None:
        self.path, self.version = str(path), str(version)

    def restore(self, engine: ServerProcess) -> None:
        if self.path is None:
            return  # never synced: the engine's start-up weights are the current ones
        from rl_sglang.client import EngineClient

        async def load():
            async with EngineClient(engine.url, api_key=engine.api_key) as client:
                await client.update_weights_from_disk(self.path, weight_version=self.version)

        asyncio.run(load())


class HealthMonitor:
    """A daemon thread checking each engine every ``interval_s``; see the module doc."""

    def __init__(
        self,
        engines: Sequence[ServerProcess],
        *,
        router=None,
        restore: RestoreFn | None = None,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        failures_to_restart: int = 2,
        max_restarts: int = 3,
    ):
        if interval_s <= 0 or timeout_s <= 0 or failures_to_restart < 1 or max_restarts < 0:
            raise ValueError(
                "need interval_s > 0, timeout_s > 0, failures_to_restart >= 1, max_restarts >= 0"
            )
        self.engines, self.router, self.restore = list(engines), router, restore
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.failures_to_restart, self.max_restarts = failures_to_restart, max_restarts
        self.events: list[EngineRestart] = []
        self.errors: list[str] = []  # restarts that failed (engine left out of the router)
        self._failures = {e.url: 0 for e in self.engines}
        self._stop = threading.Event()
        self._idle = threading.Event()  # cleared while an engine is being restarted
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._restarting = threading.Lock()  # held from a restart's decision to its end

    @property
    def exit_detection_bound_s(self) -> float:
        return self.interval_s + len(self.engines) * self.timeout_s

    @property
    def detection_bound_s(self) -> float:
        return self.failures_to_restart * self.exit_detection_bound_s

    def start(self) -> "HealthMonitor":
        self._thread = threading.Thread(target=self._run, name="engine-health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """No restart begins once this returns; one in progress is waited for. A health
        check in flight is not (up to ``timeout_s`` of an HTTP call, 0.8 s at a run's end
        on a busy 2-core CPU): its daemon thread ends after it, restarting nothing."""
        self._stop.set()
        with self._restarting:
            pass

    def __enter__(self) -> "HealthMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for check in (self.exited, self.unresponsive):  # cheap process checks first
                for engine in list(self.engines):
                    reason = check(engine)
                    if reason is not None:
                        with self._restarting:
                            if not self._stop.is_set():
                                self._recover(engine, reason)

    def exited(self, engine: ServerProcess) -> str | None:
        if engine.alive():
            return None
        return f"exited (code {engine.process.poll() if engine.process else None})"

    def unresponsive(self, engine: ServerProcess) -> str | None:
        """None while /health answers, else (after enough failures) why it counts as dead."""
        if http_ok(engine.url + "/health", timeout_s=self.timeout_s):
            self._failures[engine.url] = 0
            return None
        self._failures[engine.url] += 1
        failures = self._failures[engine.url]
        return f"{failures} failed health checks" if failures >= self.failures_to_restart else None

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block while a restart is in progress (e.g. before pushing weights to every
        engine); False when it is still going after ``timeout_s``."""
        return self._idle.wait(timeout_s)

    def _recover(self, engine: ServerProcess, reason: str) -> None:
        self._idle.clear()
        try:
            self._restart(engine, reason)
        finally:
            self._idle.set()

    def _restart(self, engine: ServerProcess, reason: str) -> None:
        detected = time.monotonic()
        log.warning("engine %s is dead (%s); restarting", engine.url, reason)
        restarts = sum(e.url == engine.url for e in self.events)
        if restarts >= self.max_restarts:
            self._give_up(engine, f"{reason}; {restarts} restarts already, giving up")
            return
        self._deregister(engine.url)
        try:
            engine.kill()  # a hung process is still running: make sure it is gone
            engine.start(wait=True)
            started = time.monotonic()
            if self.restore is not None:
                self.restore(engine)
            restored = time.monotonic()
            if self.router is not None:
                self.router.add_worker(engine.url)
        except Exception as error:  # a failed restart is recorded, the others go on
            self._give_up(engine, f"{reason}; restart failed: {type(error).__name__}: {error}")
            return
        self._failures[engine.url] = 0
        self.events.append(
            EngineRestart(
                engine.url,
                reason,
                detected,
                started - detected,
                restored - started,
                time.monotonic() - detected,
            )
        )

    def _deregister(self, url: str) -> None:
        if self.router is not None and url in self.router.worker_urls():
            self.router.remove_worker(url)

    def _give_up(self, engine: ServerProcess, message: str) -> None:
        log.error("engine %s: %s", engine.url, message)
        self.errors.append(f"{engine.url}: {message}")
        self.engines.remove(engine)
        self._deregister(engine.url)
