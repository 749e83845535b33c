"""What the loops ask of a run's rollout, whatever kind it is: the engine-backed
:class:`~rl_launcher.roles.rollout_manager.RolloutManager` (rollout-only runs and
``rl-eval`` included), the buffer-fed :class:`~rl_launcher.roles.buffer_rollout.BufferRollout`
and the replay stand-in :class:`~rl_launcher.infra.dumps.ReplayRollout`.

Every kind implements all of it; a kind that has nothing to say gives a neutral value
(no engines: a :class:`~rl_launcher.roles.engine_pool.NoEngines` whose answers are empty;
no reward: ``reward_fn is None``; nothing drawn: ``consumed`` does nothing), so the loops
call it unconditionally.
"""

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rl_core.types import Sample
    from rl_launcher.roles.engine_pool import EnginePool, NoEngines
    from rl_launcher.roles.reward import Reward

Groups = list[list["Sample"]]


class RolloutRole(Protocol):
    engines: "EnginePool | NoEngines"  # start, sync, health, memory: roles.engine_pool
    reward_fn: "Reward | None"  # its failure counts reach every step's record

    def rollout(self, num_groups: int, step: int | None = None) -> tuple[Groups, dict[str, float]]:
        """``num_groups`` scored groups and the rollout's metrics, for rl-train step ``step``
        (a rollout function's ``ctx.step``; None: the step after the engines' weights)."""

    def consumed(self, groups: Groups) -> None:
        """The loop is done with these groups (trained on or dropped)."""

    def data_state(self) -> dict:
        """The data position a checkpoint keeps: ``{"source": ..., "pending": [...]}``."""

    def load_data_state(self, state: dict) -> None:
        """Continue from :meth:`data_state`."""

    def stop(self) -> None: ...
