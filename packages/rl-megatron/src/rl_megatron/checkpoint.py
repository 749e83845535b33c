"""Atomic per-rank checkpoints: every rank writes its shard into a temporary sibling
directory, then global rank 0 renames it into place, so a crash never leaves a
half-written checkpoint under the final name. ``meta.json`` is written last, once every
rank's file is on disk: a directory without it is never loaded. A SIGKILL between the two
renames of :func:`swap_into_place` leaves the previous checkpoint at ``.<name>.old``,
which :func:`load_sharded` falls back to.

Layout of ``path``: ``meta.json`` (world and TP sizes, step) and ``rank_XXXXX.pt`` per rank
holding model parameters, optimizer state, step and RNG states.
"""

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_sharded(path: str | Path, state: dict, meta: dict) -> None:
    """Write this rank's ``state`` under ``path`` atomically (all ranks call together)."""
    path = Path(path)
    rank, world = _rank_world()
    tmp = path.parent / f".{path.name}.partial"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    torch.save(state, tmp / f"rank_{rank:05d}.pt")
    _barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({**meta, "world_size": world}))
        swap_into_place(tmp, path)
    _barrier()


def swap_into_place(ready: Path, final: Path) -> None:
    """Rename the finished directory ``ready`` to ``final``; an existing ``final`` is first
    renamed aside and deleted only after, so no crash leaves a half-written ``final``."""
    old = _old_path(final)
    if final.exists():  # complete (only this rename creates it): it becomes the fallback
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(ready, final)  # a fallback left by a crash here stays until this succeeds
    shutil.rmtree(old, ignore_errors=True)


def _old_path(path: Path) -> Path:
    return path.parent / f".{path.name}.old"


def complete_path(path: Path) -> Path:
    """``path`` if it holds a complete checkpoint, else the previous one that a crash in
    :func:`swap_into_place` left aside; ValueError if neither."""
    for candidate in (path, _old_path(path)):
        if (candidate / "meta.json").is_file():
            return candidate
    raise ValueError(
        f"{path} is not a complete checkpoint (no meta.json): it was not saved or its save "
        "was interrupted; load an earlier checkpoint"
    )


def load_sharded(path: str | Path, meta: dict) -> dict:
    """This rank's state from ``path``; ``meta`` entries must match what was saved."""
    path = complete_path(Path(path))
    rank, world = _rank_world()
    saved = json.loads((path / "meta.json").read_text())
    expected = {**meta, "world_size": world}
    for key, value in expected.items():
        if saved.get(key) != value:
            raise ValueError(
                f"checkpoint {path} was saved with {key}={saved.get(key)}, this run has "
                f"{key}={value}; resume with the same parallel layout"
            )
    return torch.load(path / f"rank_{rank:05d}.pt", weights_only=True)
