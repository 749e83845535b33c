"""Stand-in engines and training ranks for measuring the control plane at scale
(``bench/scale_sim.py``, issue 33): the launcher's own start-up, placement, router,
rollout, buffer, loop, weight-sync orchestration and checkpoints run; engines and ranks
speak the real protocols (SGLang's HTTP API; the training group's driver API over Ray)
while their compute is modeled (:class:`~rl_launcher.simulated.engine.SimModel`).

    with simulated_roles(SimModel(train_s=0.2)):
        train(config)   # rl_launcher.loops.rl.train, unchanged

The seam: while the context is open, the training group the launcher starts is
:class:`~rl_launcher.simulated.trainer.SimTrainGroup` (one light actor per simulated node
hosting its ranks) and the engine pool's servers are
:func:`~rl_launcher.simulated.engine.start_sim_engines` (one light actor per node serving
its engines). Nothing else is replaced (``rollout.data_plane: workers`` runs its real
rollout workers, one per node, against the stand-in engines); runs need Ray placement
(``start_run``), so every engine has a site.

Colocated layouts with the synchronous loop take turns as on GPUs
(:mod:`rl_launcher.infra.colocation`, whose test of ``cluster.device: cuda`` is widened to
these CPU bundles while the context is open): the engines release their memory before the
log-prob pass and resume it for the weight sync, the ranks' offload starts before the rollout
(and runs during it) and they onload after, each transition taking the model's time
(``release_s`` ...). The overlapping
loops, which colocated GPUs refuse, run colocated without turns.
"""

import contextlib
from collections.abc import Iterator

from rl_launcher.simulated.engine import SimModel

__all__ = ["SimModel", "simulated_roles"]


@contextlib.contextmanager
def simulated_roles(model: SimModel) -> Iterator[None]:
    """Start stand-in roles instead of the real ones while open (see the module docstring)."""
    from rl_launcher.infra import colocation
    from rl_launcher.roles import engine_pool, train_group
    from rl_launcher.simulated.engine import start_sim_engines
    from rl_launcher.simulated.trainer import SimTrainGroup

    def start_servers(config, *, sites=None, **_):
        if sites is None:
            raise ValueError("simulated engines start on placed nodes: run under start_run")
        return start_sim_engines(config, sites, model=model)

    def turns_needed(config, plan) -> bool:  # colocated on CPU bundles as on GPUs
        idle = config.backend.offload_when_idle or config.engine.release_when_idle
        return plan.colocate and config.rollout.loop == "sync" and idle

    saved = train_group.TrainGroup, engine_pool.start_servers, colocation.turns_needed
    SimTrainGroup.model = model
    train_group.TrainGroup, engine_pool.start_servers = SimTrainGroup, start_servers
    colocation.turns_needed = turns_needed
    try:
        yield
    finally:
        train_group.TrainGroup, engine_pool.start_servers, colocation.turns_needed = saved
