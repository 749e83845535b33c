"""Sharded checkpoints with torch.distributed.checkpoint, written atomically.

Layout of ``path`` (a directory; every rank must see the same filesystem):
    dcp/                  model and optimizer shards (torch.distributed.checkpoint)
    trainer_state.pt      step and LR-scheduler state (rank 0)
    rng_rank{r}.pt        RNG states of rank r (torch CPU/CUDA, python)
    adapter.json          LoRA runs only: base model and spec (the shards hold only the
                          trainable adapters and their optimizer state)
    reference/            a KL reference refreshed from the policy (rl-train's
                          algorithm.ref_update_interval) only: its shards, loaded back by
                          :func:`load_reference` (the starting reference is rebuilt instead)
Everything is written to ``<path>.tmp`` first; once all ranks finished, rank 0 moves an
existing ``path`` aside to ``<path>.old``, renames ``<path>.tmp`` to ``path`` and deletes
``<path>.old``. A SIGKILL at any point leaves either the previous or the new checkpoint
complete under ``path``, or (between the two renames) the previous one under
``<path>.old``, which :func:`load` then falls back to. ``trainer_state.pt`` is written last
(after every rank's shards), so a directory without it is never taken for a checkpoint.
"""

import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

# torch.distributed.checkpoint is imported where a checkpoint is written or read: it takes
# about 0.8 s to import, which every training rank would otherwise pay at start-up.

TRAINER_STATE = "trainer_state.pt"
ADAPTER = "adapter.json"
REFERENCE = "reference"


def _tmp_path(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _old_path(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def publish(ready: Path, path: Path) -> None:
    """Put the finished directory ``ready`` at ``path``; the previous ``path`` is deleted
    only once the new one is in place (see the module docstring)."""
    old = _old_path(path)
    if path.exists():  # complete (only renames create it): it becomes the fallback
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(ready, path)  # a fallback left by a crash here stays until this succeeds
    shutil.rmtree(old, ignore_errors=True)


def complete_path(path: Path) -> Path:
    """``path`` if it holds a complete checkpoint, else the previous one that a crash
    between :func:`publish`'s two renames left at ``<path>.old``; ValueError if neither."""
    for candidate in (path, _old_path(path)):
        if (candidate / TRAINER_STATE).is_file():
            return candidate
    raise ValueError(
        f"{path} is not a complete checkpoint (no {TRAINER_STATE}); it was not saved or its "
        "save was interrupted: load an earlier checkpoint"
    )


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


def _options(adapter: dict | None):
    """An adapter run saves and loads its trainable parameters only (the frozen base is
    rebuilt from where it came from)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=adapter is not None, strict=adapter is None)


def _model_state(model, optimizer, adapter: dict | None):
    """``get_state_dict`` of the parts a checkpoint holds. ``ignore_frozen_params`` keeps
    a tied weight's second name (``lm_head.weight``), so an adapter run also filters by
    the trainable parameters' names."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_options(adapter))
    if adapter is not None:
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        model_state = {k: v for k, v in model_state.items() if k in trainable}
    return model_state, optim_state


def save(
    path: Path,
    model,
    optimizer,
    scheduler,
    step: int,
    *,
    adapter: dict | None = None,
    reference: torch.nn.Module | None = None,
):
    """Write model, optimizer, scheduler, RNG and step under ``path`` (all ranks call);
    with ``adapter`` (JSON-ready), only trainable parameters, and ``adapter`` to
    ``adapter.json``; with ``reference``, that model's weights to ``reference/``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    rank, tmp = dist.get_rank(), _tmp_path(path)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if adapter is not None:
            (tmp / ADAPTER).write_text(json.dumps(adapter, indent=2))
    dist.barrier()
    model_state, optim_state = _model_state(model, optimizer, adapter)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp / "dcp"))
    if reference is not None:
        dcp.save({"model": get_model_state_dict(reference)}, checkpoint_id=str(tmp / REFERENCE))
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    dist.barrier()
    if rank == 0:  # the completeness mark, once every rank's part is on disk
        state = {"step": step, "scheduler": scheduler.state_dict()}
        torch.save({**state, "world_size": dist.get_world_size()}, tmp / TRAINER_STATE)
        publish(tmp, path)
    dist.barrier()


def load(path: Path, model, optimizer, scheduler, *, adapter: dict | None = None) -> int:
    """Restore everything :func:`save` wrote; returns the step. RNG is restored for ranks
    that existed at save time (a different world size keeps the others' RNG). A LoRA
    checkpoint loads only into a model with the same LoRA spec."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = complete_path(path)
    _check_adapter(path, adapter)
    model_state, optim_state = _model_state(model, optimizer, adapter)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_options(adapter),
    )
    trainer = torch.load(path / TRAINER_STATE, weights_only=True)
    scheduler.load_state_dict(trainer["scheduler"])
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True))
    return int(trainer["step"])


def load_reference(path: Path, reference: torch.nn.Module) -> bool:
    """``reference``'s weights from the checkpoint at ``path`` when :func:`save` wrote
    them (all ranks call); whether it did."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = complete_path(path) / REFERENCE
    if not path.is_dir():
        return False
    state = {"model": get_model_state_dict(reference)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(reference, state["model"])
    return True


def _check_adapter(path: Path, adapter: dict | None) -> None:
    """The checkpoint's LoRA spec must be the model's (the base is recorded, not checked:
    a run directory may move)."""
    saved = json.loads((path / ADAPTER).read_text()) if (path / ADAPTER).is_file() else None
    if saved is None and adapter is None:
        return
    if saved is None or adapter is None:
        has, wants = ("no", "a") if saved is None else ("a", "no")
        raise ValueError(
            f"{path} holds {has} LoRA adapter but the model has {wants} LoRA spec: load it "
            "with the lora setting it was trained with"
        )
    if saved["lora"] != adapter["lora"]:
        raise ValueError(
            f"{path} was trained with LoRA {saved['lora']}, this model has {adapter['lora']}: "
            "use the lora settings it was trained with"
        )
