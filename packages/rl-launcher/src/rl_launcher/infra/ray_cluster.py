"""Start or attach to Ray: ``cluster.ray_address``, else ``RAY_ADDRESS``, else a local Ray.

:func:`check_before_ray` finds, in seconds, what would otherwise fail late inside Ray: a
cluster address where nothing answers (``ray.init`` waits for it for ever) and, for a local
Ray on ``cluster.device=cuda``, fewer GPUs than the placement reserves (Ray would wait for
them, then fail naming bundles, not options).

:func:`start_early` begins a local Ray on a background thread as soon as the config is
checked: its helper processes take seconds to come up, time in which the driver imports
torch and loads the model and prompts; :func:`connect` then takes it over.
"""

import logging
import os
import socket
import sys
import threading
from concurrent.futures import Future

# Ray re-launches every worker through `uv run` when the driver runs under `uv run`
# (RAY_ENABLE_UV_RUN_RUNTIME_ENV, on by default), packaging the working directory so that
# actors run elsewhere. For a local Ray that is pointless (the workers already use this
# interpreter), moves relative paths from under the actors and breaks under tox/CI, so it
# is switched off, unless the user set it. Ray reads it once, when `ray` is first
# imported: call :func:`prepare_local_ray_env` before anything imports ray.
# RAY_AUTH_MODE=token asks for what a new local Ray does by default (a generated token),
# explicitly, so Ray does not print its notice about having chosen it.
LOCAL_RAY_ENV = {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
}
_early: Future | None = None  # the local Ray start_early began, until connect takes it


def prepare_local_ray_env(address: str | None = None) -> None:
    """Set :data:`LOCAL_RAY_ENV` (where unset) when no cluster address is given."""
    if (address or os.environ.get("RAY_ADDRESS")) is None:
        for name, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(name, value)


def cluster_address(address: str | None) -> tuple[str | None, str]:
    """The Ray address a run attaches to and the name of where it came from (the option or
    the environment variable); ``(None, ...)`` when a local Ray is started."""
    if address:
        return address, "cluster.ray_address"
    return os.environ.get("RAY_ADDRESS") or None, "RAY_ADDRESS"


def check_reachable(address: str | None, timeout_s: float, source: str = "address") -> None:
    """ValueError naming ``address`` when nothing accepts a TCP connection at its host:port
    within ``timeout_s`` (``ray.init`` would keep retrying for ever). ``auto`` and ``local``
    are resolved by Ray on this machine and are not checked."""
    if address is None or address in ("auto", "local"):
        return
    host, port = _host_port(address, source)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        timed_out = isinstance(error, TimeoutError)
        reason = f"no answer within {timeout_s:g}s" if timed_out else error.strerror or error
        raise ValueError(
            f"{source}={address!r}: no Ray cluster at {host}:{port} ({reason}); start it "
            "(ray start --head), fix the address, or unset it to start a local Ray "
            "(cluster.connect_timeout_s sets the wait)"
        ) from None


def _host_port(address: str, source: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``ray://host[:port]`` (Ray Client, port 10001)."""
    client = address.startswith("ray://")
    rest = address.removeprefix("ray://").split("/", 1)[0]
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]")
        port = port.removeprefix(":")
    elif rest.count(":") == 1:
        host, port = rest.split(":")
    else:
        host, port = rest, ""
    if client and not port:
        port = "10001"
    if not host or not port.isdigit():
        raise ValueError(f"{source}={address!r} is not host:port (e.g. 10.0.0.1:6379)")
    return host, int(port)


def check_local_gpus(config) -> None:
    """``cluster.device=cuda`` with a local Ray: this machine must have every GPU that the
    placement reserves. Attached to a cluster, the driver's own GPUs do not matter."""
    from rl_launcher.infra.placement import plan_from_config

    if config.cluster.device != "cuda" or cluster_address(config.cluster.ray_address)[0]:
        return
    ray = sys.modules.get("ray")  # a Ray this process already joined places the bundles
    if ray is not None and ray.is_initialized():
        return
    import torch

    needed = plan_from_config(config).num_bundles
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < needed:
        why = "" if found else "torch.cuda.is_available() is False"
        if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
            why += f"{', ' if why else ''}CUDA_VISIBLE_DEVICES={visible!r}"
        seen = f"{found}" + (f" ({why})" if why else "")
        raise ValueError(
            f"cluster.device=cuda: the placement needs {needed} GPU(s) on this machine "
            f"(cluster.num_nodes x cluster.devices_per_node, used by backend.num_ranks and "
            f"engine.num_engines x engine.devices_per_engine) but torch sees {seen}; use "
            "cluster.device=cpu, a smaller layout, or cluster.ray_address of a GPU cluster"
        )


def check_before_ray(config) -> None:
    """Devices and the cluster address, checked before Ray starts; ValueError naming the
    option at fault."""
    check_local_gpus(config)
    address, source = cluster_address(config.cluster.ray_address)
    check_reachable(address, config.cluster.connect_timeout_s, source)


def connect(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    connect_timeout_s: float = 30.0,
) -> str:
    """Initialise Ray once; returns ``"attached"``, ``"started"`` or ``"already running"``.

    ``num_cpus`` / ``num_gpus`` size a local instance only (they may be fake, e.g. 8 GPUs
    on a laptop for scheduling tests); a cluster reports its own resources. An address
    where nothing answers within ``connect_timeout_s`` is a ValueError naming it. Without
    an address a new local Ray starts even where ``ray start`` runs a cluster on this
    machine (a bare ``ray.init`` would join that one, then refuse the resources); give its
    address (``RAY_ADDRESS``) to run on it.
    """
    global _early
    address, source = cluster_address(address)
    prepare_local_ray_env(address)
    if address is None and _early is not None:  # begun by start_early: wait for it
        early, _early = _early, None
        return early.result()
    import ray

    if ray.is_initialized():
        return "already running"
    if address is not None:
        check_reachable(address, connect_timeout_s, source)
        ray.init(address=address, log_to_driver=True)
        return "attached"
    return _start_local(num_cpus, num_gpus)


def _start_local(num_cpus: int | None, num_gpus: int | None) -> str:
    import ray

    ray.init(
        address="local",  # not a cluster `ray start` left on this machine: only when told
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    return "started"


def local_cpus(config) -> int:
    """The CPUs of the local Ray a run starts: the machine's, or as many as the placement's
    bundles reserve where that is more."""
    from rl_launcher.infra.placement import plan_from_config

    bundles = plan_from_config(config).num_bundles
    return int(max(os.cpu_count() or 1, bundles * config.cluster.cpus_per_bundle))


def start_early(config) -> None:
    """Begin the local Ray that :func:`connect` would start for an RL run's trainer on a
    background thread now (nothing for other runs, a cluster address, or a process that
    already joined a Ray). Most of Ray's start is spent waiting on its helper processes
    (GCS, dashboard, raylet and its agents, prestarted workers), which the driver's own
    start-up (torch, the engines' launch) then overlaps. Off the main thread Ray replaces
    no Python signal handler; its core worker's C++ SIGTERM handler gives way to the
    launcher's once :func:`connect` takes this Ray (:func:`rl_launcher.infra.stopping.
    ray_starting`), so a SIGTERM before that aborts the start-up, as during ``ray.init``.
    :func:`stop_early` stops one that no :func:`connect` took."""
    global _early
    ray = sys.modules.get("ray")
    if (
        _early is not None
        or config.mode != "rl"
        or config.rollout.rollout_only
        or cluster_address(config.cluster.ray_address)[0] is not None
        or (ray is not None and ray.is_initialized())
    ):
        return
    prepare_local_ray_env(None)
    import ray  # on this thread: two threads importing modules at once may deadlock

    logging.getLogger("ray._private.worker").addFilter(_no_sigterm_note)
    _early = Future()
    starter = threading.Thread(
        target=_start_and_stay, args=(_early, local_cpus(config)), name="ray-start", daemon=True
    )
    starter.start()


def _no_sigterm_note(record: logging.LogRecord) -> bool:
    """Drops Ray's warning that off the main thread it sets no SIGTERM handler: wanted
    here, the launcher's handlers stay (:mod:`rl_launcher.infra.stopping`)."""
    return not record.getMessage().startswith("SIGTERM handler is not set")


def _start_and_stay(started: Future, num_cpus: int) -> None:
    """``ray.init`` into ``started``, then parked for good: the kernel SIGKILLs Ray's head
    processes when the *thread* that started them ends (their PR_SET_PDEATHSIG), so this
    one lives as long as the process."""
    try:
        started.set_result(_start_local(num_cpus, None))
    except BaseException as error:  # handed to connect, which raises it
        started.set_exception(error)
        return
    threading.Event().wait()


def starting_early() -> bool:
    """Whether :func:`start_early` began a Ray that no :func:`connect` has taken yet."""
    return _early is not None


def stop_early(*, wait: bool = True) -> None:
    """Stop the Ray of :func:`start_early` when the run ended before :func:`connect` took
    it (a fault or a refusal during start-up); a taken one stops with its run. Without
    ``wait`` one still starting is left as it is (the process is about to end, and with it
    the thread Ray's head processes are tied to)."""
    global _early
    early, _early = _early, None
    if early is None or not (wait or early.done()):
        return
    if early.exception() is None:
        stop_local_ray()


def stop_local_ray() -> None:
    """``ray.shutdown()`` of the local Ray this process started, less its wait on the
    autoscaler's monitor: Ray stops its processes one by one, each given 1 s to exit on
    SIGTERM, and the monitor (which has nothing to save on a local Ray) takes the whole
    second; it is SIGKILLed first, the rest stop as Ray stops them (raylet, GCS, ...)."""
    import ray

    _kill_monitor(getattr(ray._private.worker, "_global_node", None))
    ray.shutdown()


def _kill_monitor(node) -> None:
    from ray._private import ray_constants

    if node is None or not node.is_head():
        return
    for info in node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []):
        if info.process.poll() is None:
            info.process.kill()
            info.process.wait(5)  # reaped: ray.shutdown then passes over it
