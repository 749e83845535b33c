"""Engine servers started on their own nodes, each by a Ray actor in its own bundles.

    sites = engine_sites(config, plan, placement)       # checked before anything starts
    engines = start_placed_engines(config, sites, model_dir=d, log_dir=l, max_batch_size=64)
    for e in engines: e.wait_ready()
    engines[0].url, engines[0].node_id                   # http://<node address>:<port>, Ray node

Each engine's :class:`EngineHost` actor is scheduled into the engine's first placement
bundle (an SGLang engine over several whole nodes, ``engine.devices_per_engine`` >
``cluster.devices_per_node``: one actor per node of the engine, in its first bundle there,
each launching ``sglang.launch_server`` with ``--nnodes``, ``--node-rank`` and
``--dist-init-addr`` at node rank 0's address; only node rank 0 serves HTTP, and the
engine's actors live, die and restart as one) with no resources of its own (the bundle's stay with the training rank sharing it,
or with the engine process), so it runs on the node the plan gives the engine. There it
builds the server (:func:`rl_launcher.roles.engine_servers.engine_process`) on a port free on that
node, with the bundles' GPU ids, bound to loopback when the whole run is on the driver's
node (``engine.host``) and else to the node's address (Ray's node IP), which needs the API
key; it starts the server tied to itself (:mod:`rl_launcher.infra.lifetime`), so the server
dies with its actor. :class:`PlacedEngine` is the driver's handle, shaped like rl-sglang's
ServerProcess (``url``, ``api_key``, ``alive``, ``start``, ``wait_ready``, ``kill``,
``stop``, ``process.pid``, ``process.poll()``), so the router, the rollout manager and the
health monitor use it as a local server: a restarted engine comes back through the same
actor, on its node, on its port. Generation, aborts, memory release and weight updates go
straight to the URL.

The API key is the driver's ``RL_SGLANG_API_KEY``, handed to every engine; the driver's
router and clients read the same variable, and so do the training ranks, which send the
weights: off loopback it must be set for rl-train and on every node of the run (checked at
start-up, :func:`check_key_on_nodes`).
"""

import contextlib
import hashlib
import os
from dataclasses import dataclass

import ray

from rl_launcher.infra.weight_sync import engine_senders
from rl_sglang.process import API_KEY_ENV

KEY_NEEDED = (
    "set {variable} to one secret in the environment of rl-train and of every Ray node "
    '(`ray start`, or `ray job submit --runtime-env-json \'{{"env_vars": {{"{variable}": '
    "...}}}}'`): engines on other nodes than the driver's listen on their node's address, "
    "and control calls need the key"
)


@dataclass(frozen=True)
class EngineSites:
    """Where a run's engines start: ``plan.engine_bundles[e]`` of ``placement``, bound to
    ``host`` (None: each node's own address) with ``api_key``; ``senders[e]``: the
    training rank that hands engine e its weights
    (:func:`~rl_launcher.infra.weight_sync.engine_senders`)."""

    plan: object  # placement.PlacementPlan
    placement: object  # ray_placement.OrderedPlacement
    host: str | None
    api_key: str | None
    senders: tuple[int, ...] = ()

    def gpu_ids(self, bundles) -> list[int] | None:
        """Physical GPU ids of ``bundles`` (None for CPU bundles)."""
        if not self.placement.use_gpu:
            return None
        return [self.placement.gpu_ids[b] for b in bundles]


def engine_sites(config, plan, placement, *, transport: str) -> EngineSites:
    """The run's :class:`EngineSites`, after the checks that need no engine: every engine
    fed by a training rank that can reach it; off loopback, the API key set here and on
    every sending training rank's node. ValueError with the fix otherwise."""
    spanning = [e for e in range(len(plan.engine_bundles)) if len(plan.engine_parts(e)) > 1]
    if spanning and transport == "tensor":  # config/checks.py says so before Ray
        raise ValueError(
            f"engines {spanning} span nodes and engine.weight_sync=tensor hands tensor "
            "handles within one node; set engine.weight_sync to distributed or disk"
        )
    senders, api_key = (
        tuple(weight_senders(plan, placement, transport)),
        os.environ.get(API_KEY_ENV),
    )
    if on_driver_node(placement):
        return EngineSites(plan, placement, config.engine.host, api_key, senders)
    if not api_key:
        raise ValueError(KEY_NEEDED.format(variable=API_KEY_ENV))
    check_key_on_nodes(placement, [plan.train_bundles[r] for r in sorted(set(senders))], api_key)
    return EngineSites(plan, placement, None, api_key, senders)


def on_driver_node(placement) -> bool:
    """Whether every bundle of the run is on the driver's node (engines on loopback)."""
    return set(placement.node_ids) == {ray.get_runtime_context().get_node_id()}


def weight_senders(plan, placement, transport: str) -> list[int]:
    """Engine e's sending training rank: with ``tensor`` (handles that do not cross nodes)
    the lowest rank on its node, else rank 0."""
    engine_nodes = [placement.node_ids[bundles[0]] for bundles in plan.engine_bundles]
    rank_nodes = [placement.node_ids[slot] for slot in plan.train_bundles]
    return engine_senders(engine_nodes, rank_nodes, transport)


def key_digest(key: str | None) -> str:
    return hashlib.sha256((key or "").encode()).hexdigest()


@ray.remote(num_cpus=0)
def _node_key_digest() -> tuple[str, str]:
    return ray.util.get_node_ip_address(), key_digest(os.environ.get(API_KEY_ENV))


def check_key_on_nodes(placement, slots, api_key: str) -> None:
    """The processes in ``slots`` (the training ranks that send the weights) see the
    driver's key; only digests travel."""
    probes = [
        _node_key_digest.options(scheduling_strategy=placement.strategy(s)).remote() for s in slots
    ]
    for address, digest in ray.get(probes):
        if digest != key_digest(api_key):
            raise ValueError(
                f"node {address} has another {API_KEY_ENV} than rl-train, or none: "
                + KEY_NEEDED.format(variable=API_KEY_ENV)
            )


def start_placed_engines(
    config,
    sites: EngineSites,
    *,
    model_dir,
    log_dir,
    max_batch_size: int,
    memory_saver: bool = False,
) -> list["PlacedEngine"]:
    """Each engine's :class:`EngineHost` actors (one per node of the engine) in its
    bundles, every server started (not yet ready): all load at once."""
    options = {
        "model_dir": str(model_dir),
        "log_dir": str(log_dir),
        "host": sites.host,
        "api_key": sites.api_key,
        "max_batch_size": max_batch_size,
        "memory_saver": memory_saver,
        "ranks_per_node": config.cluster.devices_per_node,  # training ranks beside each engine
    }
    hosts: list[list] = []
    try:
        for engine in range(len(sites.plan.engine_bundles)):
            hosts.append(engine_host_actors(config, sites, engine, options))
        started = ray.get([host.start.remote() for part in hosts for host in part])
    except BaseException:  # the hosts that did start are not left behind
        for host in (host for part in hosts for host in part):
            ray.kill(host)
        raise
    found = iter(started)
    return [PlacedEngine(part, [next(found) for _ in part], sites.api_key) for part in hosts]


def engine_host_actors(config, sites: EngineSites, engine: int, options: dict) -> list:
    """One :class:`EngineHost` per node of engine ``engine``, in the first bundle of its
    part there; an engine over several nodes gets SGLang's ``--nnodes``, ``--node-rank``
    and ``--dist-init-addr`` (node rank 0's address, a port free there)."""
    host_actor = ray.remote(EngineHost)
    parts = sites.plan.engine_parts(engine)
    first = sites.placement.strategy(parts[0][0])
    dist_init_addr = ray.get(_free_address.options(scheduling_strategy=first).remote())
    actors = []
    for node_rank, bundles in enumerate(parts):
        multi_node = None
        if len(parts) > 1:
            multi_node = {  # strings: rl-sglang's SGLangServer drops options that equal False (0)
                "nnodes": str(len(parts)),
                "node_rank": str(node_rank),
                "dist_init_addr": dist_init_addr,
            }
        strategy = sites.placement.strategy(bundles[0])
        actors.append(
            host_actor.options(num_cpus=0, scheduling_strategy=strategy).remote(
                config, gpu_ids=sites.gpu_ids(bundles), multi_node=multi_node, **options
            )
        )
    return actors


@ray.remote(num_cpus=0)
def _free_address() -> str:
    """``address:port`` on this node for other nodes (the interface GLOO_SOCKET_IFNAME or
    NCCL_SOCKET_IFNAME names, else Ray's node IP), the port free there now."""
    from rl_launcher.infra.rendezvous import node_address
    from rl_sglang.process import free_port

    address = node_address()
    return f"{address}:{free_port(address)}"


class EngineHost:
    """A Ray actor holding one engine server on its node (see the module docstring). Its
    methods run on the actor's main thread, which lives as long as the actor: the server's
    tie to its parent (PR_SET_PDEATHSIG) holds until the actor goes."""

    def __init__(
        self,
        config,
        *,
        model_dir: str,
        log_dir: str,
        gpu_ids,
        host: str | None,
        api_key: str | None,
        max_batch_size: int,
        memory_saver: bool,
        ranks_per_node: int,
        multi_node: dict | None = None,
    ):
        from rl_launcher.infra.colocation import engine_threads_env
        from rl_launcher.infra.lifetime import tie_to_this_process
        from rl_launcher.roles.engine_servers import engine_process

        _drop_ray_thread_default()
        os.environ.pop(API_KEY_ENV, None)  # the server holds the driver's key, not the node's
        host = host or ray.util.get_node_ip_address()
        server = engine_process(
            config,
            model_dir=model_dir,
            log_dir=log_dir,
            gpu_ids=gpu_ids,
            host=host,
            max_batch_size=max_batch_size,
            memory_saver=memory_saver,
            api_key=api_key or "",
            multi_node=multi_node,
        )
        server.env = {**server.env, **engine_threads_env(config, ranks_per_node)}
        self.server = tie_to_this_process(server)
        # SGLang serves HTTP on node rank 0 only; the other nodes' ranks run its schedulers
        self.serves_http = multi_node is None or multi_node["node_rank"] == "0"

    def start(self) -> dict:
        """Start the server (not waiting for it); where it runs."""
        self.server.start(wait=False)
        return self.where()

    def where(self) -> dict:
        context = ray.get_runtime_context()
        return {
            "url": self.server.url,
            "node_id": context.get_node_id(),
            "node_address": ray.util.get_node_ip_address(),
            "host_pid": os.getpid(),
        }

    def wait_ready(self, timeout_s: float | None = None) -> str:
        """Until the server answers; a server without HTTP (node rank > 0), until it is
        seen running (asked after node rank 0 answered, which needs every node's rank).
        Its URL (a first start that found its port taken moved to another)."""
        if self.serves_http:
            self.server.wait_ready(timeout_s)
        elif not self.server.alive():
            code = self.server.process.poll() if self.server.process is not None else None
            raise RuntimeError(f"{self.server.name} exited with {code}\n{self.log_tail()}")
        return self.server.url

    def alive(self) -> bool:
        return self.server.alive()

    def poll(self) -> int | None:
        """The server's exit code, None while it runs (or before it started)."""
        return self.server.process.poll() if self.server.process is not None else None

    def pid(self) -> int | None:
        return self.server.process.pid if self.server.process is not None else None

    def kill(self) -> None:
        self.server.kill()

    def stop(self) -> None:
        self.server.stop()

    def log_tail(self, num_lines: int = 30) -> str:
        return self.server.log_tail(num_lines)


def _drop_ray_thread_default() -> None:
    """Ray sets OMP_NUM_THREADS=1 in an actor whose node did not set it (its default for
    actors without CPUs); the engine gets the node's own setting, as a server started by
    rl-train itself would, unless :func:`~rl_launcher.infra.colocation.engine_threads_env` gives
    it a share. What the node set is in the environment this process was started with."""
    try:
        with open("/proc/self/environ", "rb") as file:
            started_with = {item.split(b"=", 1)[0] for item in file.read().split(b"\0")}
    except OSError:  # not Linux: keep Ray's setting
        return
    if b"OMP_NUM_THREADS" not in started_with:
        os.environ.pop("OMP_NUM_THREADS", None)


class PlacedEngine:
    """The driver's handle on one engine: its :class:`EngineHost` actors, one per node of
    the engine (see the module docstring), treated as one: alive while every part runs,
    started, killed and stopped together (SGLang's ranks on several nodes restart as a
    group). Node rank 0 serves HTTP: ``url``, ``node_id`` and ``process.pid`` are its. A
    host whose node is gone reads as a dead engine that cannot restart."""

    name = "engine"

    def __init__(self, actors: list, where: list[dict], api_key: str | None):
        self.actors, self.api_key = list(actors), api_key
        self.url, self.node_id = where[0]["url"], where[0]["node_id"]
        self.node_address, self.host_pid = where[0]["node_address"], where[0]["host_pid"]
        self.node_ids = [part["node_id"] for part in where]  # node rank r's Ray node
        self.process = RemoteProcess(self)

    def call(self, method: str, *args, part: int = 0):
        """``method`` of node rank ``part``'s host actor; its own error, not Ray's wrapper,
        is raised."""
        return self.call_all(method, *args, parts=[part])[0]

    def call_all(self, method: str, *args, parts=None) -> list:
        """``method`` of every part's host (or those in ``parts``) at once."""
        actors = [self.actors[p] for p in parts] if parts is not None else self.actors
        try:
            return ray.get([getattr(actor, method).remote(*args) for actor in actors])
        except ray.exceptions.RayTaskError as error:
            raise (error.cause or error) from None

    def start(self, wait: bool = True) -> "PlacedEngine":
        """Start again (after :meth:`kill`): same actors, nodes and ports."""
        try:
            self.call_all("start")
        except ray.exceptions.RayActorError as error:
            raise RuntimeError(
                f"engine {self.url}: a host of it (node rank 0 on {self.node_address}) "
                f"is gone ({type(error).__name__})"
            ) from None
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Node rank 0 answers (SGLang's other ranks have joined it), then every other
        part is still running."""
        self.url = self.call("wait_ready", timeout_s)
        self.call_all("wait_ready", timeout_s, parts=range(1, len(self.actors)))

    def alive(self) -> bool:
        try:
            return all(self.call_all("alive"))
        except ray.exceptions.RayActorError:
            return False

    def healthy(self) -> bool:
        from rl_sglang.process import http_ok

        return self.alive() and http_ok(self.url + "/health")

    def kill(self) -> None:
        for part in range(len(self.actors)):
            with contextlib.suppress(ray.exceptions.RayActorError):  # its node is gone,
                self.call("kill", part=part)  # and the server with it

    def stop(self) -> None:
        """Stop the servers (SIGTERM, then SIGKILL), then their hosts."""
        for part in range(len(self.actors)):
            with contextlib.suppress(ray.exceptions.RayActorError):
                self.call("stop", part=part)
        for actor in self.actors:
            ray.kill(actor)

    def log_tail(self, num_lines: int = 30) -> str:
        tails = self.call_all("log_tail", num_lines)
        if len(tails) == 1:
            return tails[0]
        return "\n".join(f"node rank {rank}: {tail}" for rank, tail in enumerate(tails))


class RemoteProcess:
    """``engine.process`` of a :class:`PlacedEngine`: node rank 0's server pid and the
    engine's exit code (the first part's that exited), asked of the hosts each time (a
    restart changes them)."""

    def __init__(self, engine: PlacedEngine):
        self.engine = engine

    @property
    def pid(self) -> int | None:
        return self.engine.call("pid")

    def poll(self) -> int | None:
        try:
            codes = self.engine.call_all("poll")
        except ray.exceptions.RayActorError:
            return None
        return next((code for code in codes if code is not None), None)
