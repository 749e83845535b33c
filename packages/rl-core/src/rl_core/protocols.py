"""The small interfaces each role implements; the launcher only talks to these.

A training backend (rl-fsdp, rl-megatron) owns a model, its optimizer and its distributed
layout; one Ray actor per rank calls these methods with the same arguments on every rank.
"""

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
    """What every training backend provides (all ranks call each method together)."""

    def compute_log_probs(self, batch: TrainBatch, *, model: str = "actor") -> torch.Tensor:
        """Log-probs ``[N]`` (prediction-at-position, see rl_core.batch) of ``model``
        ("actor" or "ref") for this rank's batch, without building a graph."""
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's batch (micro-batched inside); returns metrics
        already reduced over ranks."""
        ...

    def export_weights(self, *, bucket_bytes: int) -> Iterator[WeightBucket]:
        """Full HF-named tensors, a bucket of at most ``bucket_bytes`` at a time (a single
        tensor larger than the bound travels alone). A tensor may share storage with the
        backend's own parameters: copy it to keep it past the next training step."""
        ...

    def save_checkpoint(self, path: Path) -> None:
        """Write model, optimizer, scheduler, RNG and step atomically under ``path``."""
        ...

    def load_checkpoint(self, path: Path) -> None: ...

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
