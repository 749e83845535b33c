"""Start or attach to Ray: ``cluster.ray_address``, else ``RAY_ADDRESS``, else a local Ray."""

import os

# Ray re-launches every worker through `uv run` when the driver runs under `uv run`
# (RAY_ENABLE_UV_RUN_RUNTIME_ENV, on by default), packaging the working directory so that
# actors run elsewhere. For a local Ray that is pointless (the workers already use this
# interpreter), moves relative paths from under the actors and breaks under tox/CI, so it
# is switched off, unless the user set it. Ray reads it once, when `ray` is first
# imported: call :func:`prepare_local_ray_env` before anything imports ray.
LOCAL_RAY_ENV = {"RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def prepare_local_ray_env(address: str | None = None) -> None:
    """Set :data:`LOCAL_RAY_ENV` (where unset) when no cluster address is given."""
    if (address or os.environ.get("RAY_ADDRESS")) is None:
        for name, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(name, value)


def connect(
    address: str | None = None, *, num_cpus: int | None = None, num_gpus: int | None = None
) -> str:
    """Initialise Ray once; returns ``"attached"``, ``"started"`` or ``"already running"``.

    ``num_cpus`` / ``num_gpus`` size a local instance only (they may be fake, e.g. 8 GPUs
    on a laptop for scheduling tests); a cluster reports its own resources.
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
    prepare_local_ray_env(address)
    import ray

    if ray.is_initialized():
        return "already running"
    if address is not None:
        ray.init(address=address, log_to_driver=True)
        return "attached"
    ray.init(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    return "started"
