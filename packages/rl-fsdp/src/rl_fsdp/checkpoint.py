"""Sharded checkpoints with torch.distributed.checkpoint, written atomically.

Layout of ``path`` (a directory; every rank must see the same filesystem):
    dcp/                  model and optimizer shards (torch.distributed.checkpoint)
    trainer_state.pt      step and LR-scheduler state (rank 0)
    rng_rank{r}.pt        RNG states of rank r (torch CPU/CUDA, python)
Everything is written to ``<path>.tmp`` first; rank 0 renames it once all ranks finished,
so a crash never leaves a half-written ``path``.
"""

import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

TRAINER_STATE = "trainer_state.pt"


def _tmp_path(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(path: Path, model, optimizer, scheduler, step: int) -> None:
    """Write model, optimizer, scheduler, RNG and step under ``path`` (all ranks call)."""
    rank, tmp = dist.get_rank(), _tmp_path(path)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / "dcp"))
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        state = {"step": step, "scheduler": scheduler.state_dict()}
        torch.save({**state, "world_size": dist.get_world_size()}, tmp / TRAINER_STATE)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    dist.barrier()


def load(path: Path, model, optimizer, scheduler) -> int:
    """Restore everything :func:`save` wrote; returns the step. RNG is restored for ranks
    that existed at save time (a different world size keeps the others' RNG)."""
    if not (path / TRAINER_STATE).is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no {TRAINER_STATE})")
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    trainer = torch.load(path / TRAINER_STATE, weights_only=False)
    scheduler.load_state_dict(trainer["scheduler"])
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return int(trainer["step"])
