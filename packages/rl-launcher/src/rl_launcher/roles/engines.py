"""Where a run's engine servers start (what they are: :mod:`rl_launcher.roles.engine_servers`).

    engines = start_engines(config, model_dir=d, log_dir=l, max_batch_size=64, sites=sites)
    for e in engines: e.wait_ready()           # all load at once, then each is waited for

With ``sites`` (a run under Ray: :class:`rl_launcher.roles.engine_hosts.EngineSites`) each
engine is started on its own node by a Ray actor in its own bundles
(:mod:`rl_launcher.roles.engine_hosts`); without (rollout-only runs and ``rl-eval``, no Ray),
as child processes of this one, on ``gpus[e]``.
"""

from pathlib import Path

from rl_launcher.infra.colocation import engine_threads_env
from rl_launcher.infra.lifetime import tie_to_this_process
from rl_launcher.roles.engine_servers import engine_processes


def start_engines(
    config,
    *,
    model_dir: Path,
    log_dir: Path,
    max_batch_size: int,
    memory_saver: bool = False,
    gpus=None,
    sites=None,
) -> list:
    """Every engine started, not yet waited for: on its own node through ``sites``, else
    here on ``gpus``. Engines generating beside training get their share of the cores."""
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
        gpus=gpus,
        max_batch_size=max_batch_size,
        memory_saver=memory_saver,
    )
    threads = engine_threads_env(config, ranks_per_node=config.cluster.devices_per_node)
    for server in servers:
        server.env = {**server.env, **threads}  # CPU cores shared with training (async)
        tie_to_this_process(server).start(wait=False)  # killed with rl-train, even by -9
    return servers
