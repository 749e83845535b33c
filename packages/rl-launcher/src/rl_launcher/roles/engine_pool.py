"""A run's engines behind one object, :class:`EnginePool`: it starts them, puts the router
in front, speaks to all of them, keeps them alive and stops them.

    pool = EnginePool(config, model_dir=d, log_dir=l)       # pool.sites / pool.turns, then
    pool.start(max_batch_size=64)                           # all load at once, then the router
    pool.url, pool.urls, pool.nodes()                       # where to generate; each engine
    pool.weight_versions(); pool.confirm_version(3)         # after a weight sync
    pool.release_memory(tags); pool.resume_memory(tags)     # colocated turns
    pool.call(pool.pause_generation())                      # in flight: back aborted; then
    pool.call(pool.continue_generation())
    pool.watch(export=..., transport=...)                   # health checks and restarts
    pool.stop()

Where the servers start: with ``sites`` (a run under Ray:
:class:`~rl_launcher.roles.engine_hosts.EngineSites`) each engine is started on its own node
by a Ray actor in its own bundles (:mod:`rl_launcher.roles.engine_hosts`); without
(rollout-only runs and ``rl-eval``, no Ray), as child processes of this one. What a server
is (embedded or SGLang, and its options): :mod:`rl_launcher.roles.engine_servers`.

One event loop runs in a background thread as long as the pool lives: every request to the
engines runs on it (the rollout's generation too), so HTTP sessions are reused between
steps and generation can overlap training (:mod:`rl_launcher.loops.feeds`).

Engines that die during a run are restarted, not fatal (:meth:`EnginePool.watch`).
rl-sglang's :class:`~rl_sglang.health.HealthMonitor` checks every engine each
``engine.health_interval_s`` seconds; a dead one is taken out of the router, restarted on
its port (a placed engine through its own host actor, so in its own bundles), given the
trainer's current weights (an HF export on disk, loaded with ``/update_weights_from_disk``
at the pool's :attr:`~EnginePool.weight_version`; with LoRA adapter sync, the current
adapter under the name every request gives) and only then put back. Requests that hit
it meanwhile are retried by the rollout on the other engines, and a weight sync waits until
the restart is over (:meth:`~EnginePool.wait_for_restarts`). With ``distributed`` weight
sync a restarted engine would be outside the trainer's weight-update group, and colocated
on GPUs it would come back holding all its memory while the others have released theirs
for training (SGLang then rejects the next resume and exits): in both cases the monitor is
off, and a dead engine stops the run at its next request, naming it.
"""

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rl_launcher.infra.colocation import engine_threads_env
from rl_launcher.infra.lifetime import tie_to_this_process
from rl_launcher.infra.weight_sync import sync_dir
from rl_launcher.roles.engine_servers import engine_processes

if TYPE_CHECKING:
    from rl_launcher.infra.colocation import Turns
    from rl_launcher.roles.engine_hosts import EngineSites
    from rl_sglang.health import HealthMonitor

ROUTER_NEEDED = "engine.use_router=false works with one engine; set engine.num_engines=1"
RESTART_WAIT_S = 600.0


class EnginePool:
    """The run's engine servers and their router (see the module docstring)."""

    def __init__(self, config, *, model_dir: Path, log_dir: Path):
        if not config.engine.use_router and config.engine.num_engines > 1:
            raise ValueError(ROUTER_NEEDED)
        self.config, self.model_dir, self.log_dir = config, Path(model_dir), Path(log_dir)
        self.servers: list = []  # rl-sglang ServerProcess or engine_hosts.PlacedEngine
        self.router = None
        self.sites: EngineSites | None = None  # under Ray (set by session.start): placed
        self.local_node: str | None = None  # started here, under Ray: this node's id
        self.turns: Turns | None = None  # colocated GPUs (set by session.start)
        self.monitor: HealthMonitor | None = None  # set by watch()
        self.weight_version = 0  # the version the engines hold (last confirmed sync)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="rollout-loop", daemon=True
        )
        self._thread.start()
        self._clients: dict = {}  # url -> EngineClient, one keep-alive session each

    def start(self, *, max_batch_size: int) -> "EnginePool":
        """Start the engines (each on its own node under Ray) all at once, wait for each,
        then the router in front of them, on this node. Servers the pool holds already
        (started before Ray by the session) are only waited for."""
        from rl_sglang.router import Router

        engine = self.config.engine
        self.servers = self.servers or start_servers(
            self.config,
            model_dir=self.model_dir,
            log_dir=self.log_dir,
            max_batch_size=max_batch_size,
            memory_saver=self._memory_saver(),
            sites=self.sites,
        )
        for server in self.servers:
            server.wait_ready()
        if engine.use_router:
            router = Router(self.urls, host=engine.host, log_dir=self.log_dir)
            self.router = tie_to_this_process(router).start()
        return self

    def _memory_saver(self) -> bool:
        """Colocated turns in which the engines give their memory up (SGLang's memory
        saver, which ``/release_memory_occupation`` needs)."""
        return self.turns is not None and self.turns.release_engines

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.servers]

    @property
    def url(self) -> str:
        """Where to generate: the router, or the one engine without it."""
        return self.router.url if self.router else self.servers[0].url

    def nodes(self) -> list[str | None]:
        """Each engine's Ray node; None for engines started without Ray."""
        if self.sites is None:
            return [self.local_node] * len(self.servers)
        return [engine.node_id for engine in self.servers]

    def client(self, url: str):
        """The pool's client of ``url``: its connections stay open across steps. The
        router's is a RouterClient: a /generate asking for routed experts (which
        sglang-router drops) goes to one of its workers, through their pool clients."""
        from rl_sglang.client import EngineClient
        from rl_sglang.router_client import RouterClient

        if url not in self._clients:
            if self.router is not None and url == self.router.url:
                self._clients[url] = RouterClient(url, worker_client=self.client)
            else:
                self._clients[url] = EngineClient(url)
        return self._clients[url]

    def call(self, coroutine):
        """Run ``coroutine`` on the pool's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def weight_versions(self) -> list[str]:
        return self.call(self._versions())

    async def _versions(self) -> list[str]:
        # /model_info: real SGLang answers 404 on /get_weight_version since 0.5
        infos = (self.client(url).request("GET", "/model_info") for url in self.urls)
        return [str(info["weight_version"]) for info in await asyncio.gather(*infos)]

    def confirm_version(self, version: int) -> None:
        """After a weight sync: every engine reports ``version``, the one a restarted
        engine is given from now on."""
        engine_versions = self.weight_versions()
        if any(v != str(version) for v in engine_versions):
            raise RuntimeError(
                f"weight sync to version {version} left engines at {engine_versions}"
            )
        self.weight_version = version

    def freeze_gc(self) -> list[str]:
        """``gc.freeze()`` in every engine's processes (SGLang's ``/freeze_gc``); what each
        engine answered, or why it could not (an engine without the endpoint keeps its
        collector as it is: this is an optimisation, not a requirement)."""
        return self.call(self._freeze_all())

    async def _freeze_all(self) -> list[str]:
        return await asyncio.gather(*(freeze_gc(self.client(u)) for u in self.urls))

    def release_memory(self, tags: list[str]) -> None:
        """Every engine frees the memory of ``tags`` (weights, kv_cache, cuda_graph)."""
        self.call(self._on_engines("/release_memory_occupation", {"tags": list(tags)}))

    def resume_memory(self, tags: list[str]) -> None:
        self.call(self._on_engines("/resume_memory_occupation", {"tags": list(tags)}))

    async def _on_engines(self, path: str, body: dict) -> None:
        await asyncio.gather(*(self.client(u).request("POST", path, body) for u in self.urls))

    async def pause_generation(self) -> None:
        """Every engine stops; requests in flight come back aborted with what they had."""
        await asyncio.gather(*(self.client(url).pause("abort") for url in self.urls))

    async def continue_generation(self) -> None:
        await asyncio.gather(*(self.client(url).resume() for url in self.urls))

    def watch(self, *, export: Callable[[str], bool], transport: str) -> None:
        """Start the health monitor (when configured and possible, see the module
        docstring). ``export(path)`` writes the trainer's weights as an HF model for a
        restarted engine; False when there is no trainer (yet): the engine's start-up
        weights are then current."""
        engine = self.config.engine
        if engine.health_interval_s <= 0:
            return
        if transport == "distributed":
            print(
                "rl-train: engine health checks are off with distributed weight sync (a "
                "restarted engine cannot rejoin the weight-update group)",
                file=sys.stderr,
            )
            return
        if self.turns is not None:
            print(
                "rl-train: engine health checks are off while engines take turns with "
                "training on the same GPUs (a restarted engine would not know the turn)",
                file=sys.stderr,
            )
            return
        from rl_sglang.health import HealthMonitor

        self.monitor = HealthMonitor(
            self.servers,
            router=self.router,
            restore=lambda e: self._restore(e, export),
            interval_s=engine.health_interval_s,
            timeout_s=engine.health_timeout_s,
            failures_to_restart=3,
            max_restarts=engine.max_restarts,
        ).start()

    def _restore(self, engine, export: Callable[[str], bool]) -> None:
        """Give a restarted ``engine`` what the others serve and the run's weight version:
        the trainer's weights (an HF export), or with ``model.lora_sync: adapter`` the
        current adapter over the base it restarted with (:func:`restore_adapter`)."""
        from rl_launcher.roles.lora import restore_adapter, syncs_adapter
        from rl_sglang.client import EngineClient

        version = self.weight_version
        if syncs_adapter(self.config):
            what = "adapter"
            root = sync_dir(self.config, self.config.logging.run_dir)

            def load(client):
                return restore_adapter(client, root, version)
        else:
            what = "weights"
            path = Path(self.config.logging.run_dir) / "restore_weights"
            if not export(str(path)):
                return

            def load(client):
                return client.update_weights_from_disk(str(path), weight_version=str(version))

        async def restore() -> str | None:
            async with EngineClient(engine.url, api_key=engine.api_key) as client:
                await load(client)
                if self.config.engine.freeze_gc:  # as the loop did for the engines after step 1
                    return await freeze_gc(client)
            return None

        if frozen := asyncio.run(restore()):
            print(f"rl-train: engine {engine.url}: {frozen}", file=sys.stderr, flush=True)
        print(
            f"rl-train: engine {engine.url} restarted with the {what} of version {version}",
            file=sys.stderr,
            flush=True,
        )

    def wait_for_restarts(self) -> None:
        """Before weights go to every engine: an engine that died and was not restarted
        yet (the monitor sees it at its next round) is waited for, then any restart in
        progress."""
        monitor = self.monitor
        if monitor is None:
            return
        deadline = time.monotonic() + RESTART_WAIT_S
        while any(not engine.alive() for engine in monitor.engines) or not monitor.wait_idle(0.2):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"engines not back after {RESTART_WAIT_S:.0f} s: {monitor.errors}"
                )
            time.sleep(0.2)

    def stop(self) -> None:
        """The monitor first (or it would restart the engines stopped here), any task still
        on the loop (a rollout a stop signal abandoned ends quietly), the clients, the
        router and the engines (together), then the loop."""
        from rl_sglang.process import stop_all

        if self.monitor is not None:
            self.monitor.stop()
        self.call(_cancel_in_flight())
        clients, self._clients = list(self._clients.values()), {}
        self.call(_close_all(clients))
        stop_all([s for s in [self.router, *self.servers] if s is not None])  # at once
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class NoEngines:
    """The engines of a run that has none (a replay): nothing to sync, every answer empty."""

    monitor = turns = None
    weight_version = 0

    @property
    def urls(self) -> list[str]:
        return []

    def nodes(self) -> list[str | None]:
        return []

    def weight_versions(self) -> list[str]:
        return []

    def confirm_version(self, version: int) -> None:
        self.weight_version = version

    def freeze_gc(self) -> list[str]:
        return []

    def wait_for_restarts(self) -> None:
        """Nothing restarts."""

    def stop(self) -> None:
        """Nothing runs."""


def start_servers(
    config,
    *,
    model_dir: Path,
    log_dir: Path,
    max_batch_size: int,
    memory_saver: bool = False,
    sites=None,
) -> list:
    """Every engine started, not yet waited for: on its own node through ``sites``, else
    here. Engines generating beside training get their share of the cores."""
    if sites is not None:
        from rl_launcher.roles.engine_hosts import start_placed_engines  # imports ray

        return start_placed_engines(
            config,
            sites,
            model_dir=model_dir,
            log_dir=log_dir,
            max_batch_size=max_batch_size,
            memory_saver=memory_saver,
        )
    servers = engine_processes(
        config,
        model_dir=model_dir,
        log_dir=log_dir,
        gpus=None,
        max_batch_size=max_batch_size,
        memory_saver=memory_saver,
    )
    threads = engine_threads_env(config, ranks_per_node=config.cluster.devices_per_node)
    for server in servers:
        server.env = {**server.env, **threads}  # CPU cores shared with training (async)
        tie_to_this_process(server).start(wait=False)  # killed with rl-train, even by -9
    return servers


async def freeze_gc(client) -> str:
    """One engine's answer to ``/freeze_gc``, or why it did not freeze: an engine without
    the endpoint keeps its collector as it is (an optimisation, not a requirement)."""
    try:
        return str(await client.freeze_gc()).strip()
    except Exception as error:  # reported, never fatal
        return f"not frozen: {error}"


async def _cancel_in_flight(timeout_s: float = 10.0) -> None:
    """Cancel every other task on this loop (a rollout still running) and wait for them, so
    none fails later on a closed client or reward pool with an error nobody reads."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)


async def _close_all(clients) -> None:
    await asyncio.gather(*(client.close() for client in clients))
