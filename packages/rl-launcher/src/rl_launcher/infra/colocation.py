"""Colocated on GPUs, the trainer and the engines take turns on the same devices:

    generate   engines hold weights + KV cache + CUDA graphs; training state offloaded
    train      engines released (all of it); training state onloaded (log-probs, steps)
    sync       engine memory resumed (all of it, in one call), weights filled from the
               trainer (CUDA IPC)
    generate   training state offloaded

The engines resume everything for the sync, beside the resident trainer, so the devices
hold both then anyway: the trainer's offload before a rollout runs while the engines
generate (the trainer's processes copy, the driver goes on), and the next turn that needs
the trainer waits for it (``time/turns/trainer_offload_wait``: the part not hidden). After
a rollout the onload likewise starts once the engines have released their memory and runs
while the driver builds the step's batches (``time/turns/trainer_onload_wait``).

Each side's half is optional: ``engine.release_when_idle`` (the engines' release/resume)
and ``backend.offload_when_idle`` (the trainer's offload/onload). When the training state
fits beside the engine's memory, keeping it resident saves moving it twice a step.

A real SGLang engine's released weights come back uninitialised, so generation right after
training, without a weight sync in between, is refused (``engine.sync_every`` must be 1).
Engines that get LoRA adapters alone (``model.lora_sync: adapter``) keep their base weights
resident and release only the KV cache and CUDA graphs: no sync would refill the base.
The trainer group calls :meth:`Turns.training` / :meth:`Turns.syncing`, the rollout
manager :meth:`Turns.generating` before their work, and the loop
:meth:`Turns.preparing_training` between a rollout and its step's batches (``rollout``
here is the run's :class:`~rl_launcher.roles.engine_pool.EnginePool`); each is a no-op when
already there.

On CPU, engines that generate while training runs (the overlapping loops) share the
node's cores with the training ranks (:func:`engines_beside_training`,
:func:`engine_threads_env`).
"""

import os
import time
from collections import defaultdict
from contextlib import contextmanager

ENGINE_MEMORY = ("weights", "kv_cache", "cuda_graph")  # SGLang's memory tags


class Turns:
    def __init__(
        self,
        trainer,
        rollout,
        *,
        offload_trainer: bool = True,
        release_engines: bool = True,
        keep_engine_weights: bool = False,
    ):
        self.trainer, self.rollout = trainer, rollout
        self.offload_trainer, self.release_engines = offload_trainer, release_engines
        self.engine_memory = [
            t for t in ENGINE_MEMORY if not (keep_engine_weights and t == "weights")
        ]
        self.released: list[str] = []  # engine memory tags released now
        self.trainer_offloaded = False
        self._offloading = None  # waits for an offload started before a rollout
        self._onloading = None  # waits for an onload started before the step's batches
        self.log: list[str] = []  # transitions, in order (for tests and debugging)
        self.seconds: dict[str, float] = defaultdict(float)  # driver wall time per transition

    def take_times(self) -> dict[str, float]:
        """``time/turns/<transition>`` seconds of the driver since the last call
        (engine_release, engine_resume, trainer_offload and trainer_onload: starting it or
        doing it, trainer_offload_wait: waiting for one that ran during a rollout,
        trainer_onload_wait: for one that ran while the driver built the batches),
        their sum ``time/turns``, and ``time/turns/in_rollout``: the part spent before a
        rollout, inside its phase."""
        times, self.seconds = dict(self.seconds), defaultdict(float)
        in_rollout = times.pop("in_rollout", 0.0)
        if not times:
            return {}
        out = {f"time/turns/{name}": seconds for name, seconds in times.items()}
        return out | {"time/turns": sum(times.values()), "time/turns/in_rollout": in_rollout}

    @contextmanager
    def _timed(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def training(self) -> None:
        """Before log-probs and training: the devices belong to the trainer."""
        self._release_engines()
        self._trainer_on()

    def preparing_training(self) -> None:
        """A rollout has ended and a training step follows: the engines release their
        memory and the trainer's onload starts, running while the driver builds the
        step's batches; :meth:`training` waits for what is left of it
        (``time/turns/trainer_onload_wait``)."""
        self._release_engines()
        self._wait_for_offload()  # each rank runs the onload after it anyway
        if self.trainer_offloaded:
            with self._timed("trainer_onload"):
                self._onloading = self.trainer.start_onload()
            self.trainer_offloaded = False
            self.log.append("onload trainer")

    def _release_engines(self) -> None:
        held = [tag for tag in self.engine_memory if tag not in self.released]
        if held and self.release_engines:
            with self._timed("engine_release"):
                self.rollout.release_memory(held)
            self.released += held
            self.log.append(f"release {'+'.join(held)}")

    def syncing(self) -> None:
        """Before a weight sync: engine memory resident, trainer weights on the device.
        Everything released is resumed at once: SGLang 0.5.15 is proven with a full
        release followed by a full resume; resuming the weights alone first is not. So
        the trainer's state and the engines' memory must fit together here; a resident
        trainer first returns the blocks its caching allocator keeps (activations)."""
        if self.released and not self.offload_trainer:
            with self._timed("trainer_empty_cache"):
                self.trainer.empty_cache()
        self._resume(list(self.released))
        self._trainer_on()

    def generating(self) -> None:
        """Before a rollout: the devices belong to the engines."""
        if "weights" in self.released:
            raise RuntimeError(
                "colocated engines released their weights for training and have not been "
                "synced since; set engine.sync_every=1 (or cluster.colocate=false)"
            )
        with self._timed("in_rollout"):
            self._hand_over_to_engines()

    def _hand_over_to_engines(self) -> None:
        self._wait_for_onload()
        if self.offload_trainer and not self.trainer_offloaded:
            with self._timed("trainer_offload"):
                if self.released:  # the engines resume into the memory it gives back
                    self.trainer.offload()
                else:  # the engines hold theirs already: offload while they generate
                    self._offloading = self.trainer.start_offload()
            self.trainer_offloaded = True
            self.log.append("offload trainer")
        self._resume(list(self.released))

    def _wait_for_offload(self) -> None:
        if self._offloading is not None:
            waiting, self._offloading = self._offloading, None
            with self._timed("trainer_offload_wait"):
                waiting()

    def _wait_for_onload(self) -> None:
        if self._onloading is not None:
            waiting, self._onloading = self._onloading, None
            with self._timed("trainer_onload_wait"):
                waiting()

    def _resume(self, tags: list[str]) -> None:
        tags = [tag for tag in tags if tag in self.released]
        if tags:
            self._wait_for_offload()
            with self._timed("engine_resume"):
                self.rollout.resume_memory(tags)
            self.released = [tag for tag in self.released if tag not in tags]
            self.log.append(f"resume {'+'.join(tags)}")

    def _trainer_on(self) -> None:
        self._wait_for_offload()
        self._wait_for_onload()
        if self.trainer_offloaded:
            with self._timed("trainer_onload"):
                self.trainer.onload()
            self.trainer_offloaded = False
            self.log.append("onload trainer")


def turns_needed(config, plan) -> bool:
    """Trainer and engines share GPUs and one of them gives its memory up when idle."""
    shared = plan.colocate and config.cluster.device == "cuda"
    return shared and (config.backend.offload_when_idle or config.engine.release_when_idle)


def make_turns(config, trainer, rollout) -> Turns:
    from rl_launcher.roles.lora import syncs_adapter

    return Turns(
        trainer,
        rollout,
        offload_trainer=config.backend.offload_when_idle,
        release_engines=config.engine.release_when_idle,
        keep_engine_weights=syncs_adapter(config),  # adapter syncs never refill the base
    )


def check_turns(config) -> None:
    if config.rollout.loop != "sync":
        raise ValueError(
            f"rollout.loop={config.rollout.loop} overlaps generation with training, which "
            "colocated GPUs cannot do (they take turns): set cluster.colocate=false or "
            "rollout.loop=sync"
        )
    if config.engine.release_when_idle and config.engine.sync_every != 1:
        raise ValueError(
            "colocated on GPUs the engines' memory is released while training, so their "
            f"weights must be synced every step: set engine.sync_every=1 (got "
            f"{config.engine.sync_every}), or engine.release_when_idle=false"
        )


def engines_beside_training(config) -> int:
    """Engines that generate while training runs on the same CPU cores (the overlapping
    loops on CPU): the cores are split between them and the training ranks, as threads
    of both spinning on the same cores made every step several times slower."""
    overlapping = config.rollout.loop != "sync" and config.cluster.device == "cpu"
    return config.engine.num_engines if overlapping and config.engine.kind == "embedded" else 0


def engine_threads_env(config, ranks_per_node: int) -> dict:
    """OMP/MKL threads of an embedded CPU engine that generates beside training ({} when
    it does not: it then has the cores to itself while the trainer waits)."""
    engines = engines_beside_training(config)
    if not engines:
        return {}
    threads = str(max(1, (os.cpu_count() or 1) // (ranks_per_node + engines)))
    return {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
