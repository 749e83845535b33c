"""The small interfaces each role implements; the launcher only talks to these.

A training backend (rl-fsdp, rl-megatron) owns a model, its optimizer and its distributed
layout; one Ray actor per rank calls these methods with the same arguments on every rank.
:func:`protocol_mismatches` lists where a class departs from a protocol's signatures (each
backend's conformance test asserts it finds none).
"""

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from rl_core.batch import TrainBatch

# A bucket of weights on their way to the engines: Hugging Face parameter names and full
# (unsharded) tensors, bounded in bytes by the exporter.
WeightBucket = list[tuple[str, torch.Tensor]]


@runtime_checkable
class TrainingBackend(Protocol):
    """What every training backend provides: the launcher calls nothing else.

    ``start`` joins the ranks' process group (:func:`rl_core.distributed.init_distributed`)
    and builds the backend from its own config, which carries the run's
    :class:`rl_core.objective.Objective`; every other method is called by all ranks
    together. ``step`` counts optimizer steps taken (restored by ``load_checkpoint``).
    """

    step: int

    @classmethod
    def start(
        cls, config, *, rank: int, world_size: int, master_addr: str, master_port: int
    ) -> "TrainingBackend":
        """Join the default process group (gloo on CPU, nccl on GPU) and build the backend."""
        ...

    @property
    def data_rank(self) -> int:
        """Which of the step's data-parallel batches this rank trains on (ranks that
        split one model, e.g. tensor-parallel peers, share one)."""
        ...

    def compute_log_probs(self, batch: TrainBatch, *, model: str = "actor") -> torch.Tensor:
        """Log-probs ``[N]`` (prediction-at-position, see rl_core.batch) of ``model``
        ("actor" or "ref") for this rank's batch, without building a graph."""
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's batch (micro-batched inside); returns metrics
        already reduced over ranks: the objective's (``loss/total``, ...),
        ``train/grad_norm``, ``train/lr`` and ``train/nonfinite_skipped``."""
        ...

    def export_weights(self, *, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Full HF-named tensors, a bucket of at most ``bucket_bytes`` at a time (a single
        tensor larger than the bound travels alone). A tensor may share storage with the
        backend's own parameters: copy it to keep it past the next training step."""
        ...

    def export_hf(self, path: Path, *, bucket_bytes: int = 1 << 30) -> None:
        """The current weights as a Hugging Face directory at ``path`` (rank 0 writes)."""
        ...

    def save_checkpoint(self, path: Path) -> None:
        """Write model, optimizer, scheduler, RNG and step atomically under ``path``."""
        ...

    def load_checkpoint(self, path: Path) -> None: ...

    def update_reference(self) -> None:
        """Make the frozen KL reference a copy of the policy's current weights (collective;
        slime's ``--ref-update-interval``); an error when the backend holds no reference."""
        ...

    def offload(self) -> None:
        """Move parameters, gradients and optimizer state off the accelerator."""
        ...

    def onload(self) -> None: ...


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation server as the rollout side sees it (SGLang's HTTP API behind it)."""

    @property
    def url(self) -> str: ...

    def health(self) -> bool: ...

    def shutdown(self) -> None: ...


def protocol_mismatches(cls: type, protocol: type) -> list[str]:
    """Where ``cls`` departs from ``protocol``: a member missing (an attribute counts when
    annotated on the class or a base), or a method whose parameters differ. A method may
    add parameters that have defaults; those of the protocol must come in the same order
    and kind, with a default wherever the protocol has one. Empty when ``cls`` conforms."""
    annotated = {name for klass in cls.__mro__ for name in vars(klass).get("__annotations__", {})}
    members = set(protocol.__annotations__) | {n for n in vars(protocol) if not n.startswith("_")}
    problems = []
    for name in sorted(members):
        wanted = inspect.getattr_static(protocol, name, None)
        got = inspect.getattr_static(cls, name, None)
        if got is None and name not in annotated:
            problems.append(f"{cls.__name__}.{name} is missing")
        elif callable(wanted) or isinstance(wanted, classmethod):
            problems += _signature_mismatches(
                f"{cls.__name__}.{name}", getattr(protocol, name), getattr(cls, name)
            )
    return problems


def _signature_mismatches(where: str, wanted, got) -> list[str]:
    expected, actual = _parameters(wanted), _parameters(got)
    shared = [p for p in actual if p.name in {e.name for e in expected}]
    problems = []
    if [(p.name, p.kind) for p in shared] != [(p.name, p.kind) for p in expected]:
        problems.append(f"{where}{inspect.signature(got)}: expected {inspect.signature(wanted)}")
    for have, want in zip(shared, expected, strict=False):
        if want.default is not want.empty and have.default is have.empty:
            problems.append(f"{where}: parameter {have.name!r} needs a default")
    for extra in actual:
        if extra not in shared and extra.default is extra.empty:
            problems.append(f"{where}: extra parameter {extra.name!r} needs a default")
    return problems


def _parameters(function) -> list[inspect.Parameter]:
    """The parameters of ``function`` but ``self`` / ``cls``."""
    parameters = list(inspect.signature(function).parameters.values())
    return parameters[1:] if parameters and parameters[0].name in ("self", "cls") else parameters
