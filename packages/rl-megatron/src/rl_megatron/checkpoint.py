"""Atomic checkpoints: every rank writes its part into a temporary sibling directory, then
global rank 0 renames it into place, so a crash never leaves a half-written checkpoint
under the final name. ``meta.json`` is written last, once every rank's part is on disk: a
directory without it is never loaded. A SIGKILL between the two renames of
:func:`swap_into_place` leaves the previous checkpoint at ``.<name>.old``, which the
loaders fall back to.

Two writers share this protocol:
- :func:`save_distributed` / :func:`load_distributed` (the backend's): megatron-core's
  distributed checkpointing (``torch_dist`` format: ``*.distcp`` files, ``.metadata``,
  ``common.pt``, megatron's ``metadata.json``) of a sharded state dict, loadable under
  another TP/PP layout;
- :func:`save_sharded` / :func:`load_sharded`: one ``rank_XXXXX.pt`` per rank, same layout
  only (plain state dicts, no megatron needed).
"""

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

DIST_FORMAT = "megatron_dist"


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _atomic_write(path: Path, write: Callable[[Path], None], meta: dict) -> None:
    """``write(tmp)`` on every rank, then ``meta.json`` and the rename by rank 0."""
    rank, world = _rank_world()
    tmp = path.parent / f".{path.name}.partial"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    write(tmp)
    _barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({**meta, "world_size": world}))
        swap_into_place(tmp, path)
    _barrier()


def save_sharded(path: str | Path, state: dict, meta: dict) -> None:
    """Write this rank's ``state`` under ``path`` atomically (all ranks call together)."""
    rank, _ = _rank_world()
    _atomic_write(Path(path), lambda tmp: torch.save(state, tmp / f"rank_{rank:05d}.pt"), meta)


def save_distributed(
    path: str | Path,
    sharded_state: dict,
    meta: dict,
    *,
    extra: Callable[[Path], None] | None = None,
) -> None:
    """Write a megatron sharded state dict under ``path`` with megatron's distributed
    checkpointing, atomically (all ranks call together; needs torch.distributed).
    ``extra(tmp)``: rank 0 adds its own files before ``meta.json`` is written."""
    from megatron.core import dist_checkpointing

    def write(tmp: Path) -> None:
        dist_checkpointing.save(sharded_state, str(tmp))
        if extra is not None and _rank_world()[0] == 0:
            extra(tmp)

    _atomic_write(Path(path), write, {**meta, "format": DIST_FORMAT})


def distributed_meta(path: str | Path, expected: dict) -> dict:
    """``meta.json`` of the complete distributed checkpoint at ``path`` (or its fallback),
    whose entries must match ``expected``; ValueError otherwise."""
    path = complete_path(Path(path))
    saved = json.loads((path / "meta.json").read_text())
    if saved.get("format") != DIST_FORMAT:
        raise ValueError(
            f"{path} is not a megatron distributed checkpoint (format {saved.get('format')!r}); "
            "it was saved by an older rl-megatron: resume it with that version"
        )
    _check_meta(path, saved, expected)
    return saved


def load_distributed(path: str | Path, sharded_state: dict, meta: dict) -> dict:
    """The state saved under ``path`` for the tensors described by ``sharded_state`` (any
    TP/PP layout: megatron reshards); ``meta`` entries must match what was saved."""
    from megatron.core import dist_checkpointing

    distributed_meta(path, meta)
    return dist_checkpointing.load(sharded_state, str(complete_path(Path(path))))


def _check_meta(path: Path, saved: dict, expected: dict) -> None:
    for key, value in expected.items():
        if saved.get(key) != value:
            raise ValueError(
                f"checkpoint {path} was saved with {key}={saved.get(key)}, this run has "
                f"{key}={value}; resume with the same setting"
            )


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
    _check_meta(path, saved, {**meta, "world_size": world})
    return torch.load(path / f"rank_{rank:05d}.pt", weights_only=True)
