"""Run checkpoints: ``<dir>/step_000010/{trainer/, critic/, hf/, state.json, manifest.json}``.

The backend writes ``trainer/`` (model, optimizer, scheduler, RNG, step; every rank has
finished when its call returns), then the launcher writes the run part (step, weight
version, data position) into ``state.json`` and, last, ``manifest.json``: the size in bytes
of every file of the checkpoint by relative path. Both are flushed to disk under a
temporary name and renamed, so a crash never leaves them half written.

A checkpoint is *loadable* when every file of its manifest is there with its size (an
``hf/`` export may be gone as a whole) and ``state.json`` parses; one without a manifest
(saved before manifests existed, or stopped between ``state.json`` and its manifest) is
loadable when its ``state.json`` parses and the trainer's completeness mark is there.
``--resume`` loads the newest loadable one and says why it skipped each newer one
(:mod:`.resume_choice`). Only loadable checkpoints are counted and pruned: ``keep_last``
of them always stay.
"""

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from rl_launcher.infra.paths import contained, inside

STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
# the backends' completeness marks (rl-fsdp's, rl-megatron's), for checkpoints without manifest
TRAINER_MARKS = ("trainer/trainer_state.pt", "trainer/meta.json")
# parts made from the trainer state (checkpoint.save_hf): one removed as a whole is not
# damage (rl-eval exports it again); one with a file missing or truncated is
DERIVED_PARTS = ("hf",)
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(config) -> Path:
    return Path(config.checkpoint.dir or Path(config.logging.run_dir) / "checkpoints")


def step_path(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Finish the checkpoint at ``path``: ``state.json``, then the manifest of every file
    under ``path``. Call it once every other file of the checkpoint is on disk."""
    _write_atomic(path / STATE_FILE, json.dumps(state, indent=1))
    _write_atomic(path / MANIFEST_FILE, json.dumps({"files": file_sizes(path)}, indent=1))


def _write_atomic(target: Path, text: str) -> None:
    """``text`` at ``target`` via a flushed temporary file and a rename (then the rename
    flushed too): after a crash or power loss ``target`` is the old or the new text."""
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, target)
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def file_sizes(path: Path) -> dict[str, int]:
    """``relative path -> size in bytes`` of every regular file under ``path`` (links are
    not followed), the manifest itself left out."""
    sizes = {}
    for folder, _, names in os.walk(path):
        for name in names:
            full = Path(folder) / name
            if full.is_file() and not full.is_symlink():
                sizes[full.relative_to(path).as_posix()] = full.stat().st_size
    sizes.pop(MANIFEST_FILE, None)
    return dict(sorted(sizes.items()))


def damage(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded, in a few words, or None if it can."""
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        return _damage_without_manifest(path)
    try:
        files = json.loads(manifest.read_text()).get("files")
    except (ValueError, AttributeError):  # not JSON (JSONDecodeError), or not a mapping
        files = None
    if not isinstance(files, dict) or not all(isinstance(n, int) for n in files.values()):
        return f"{MANIFEST_FILE} unreadable"
    if (why := state_damage(path)) is not None:
        return why
    for name, size in files.items():
        part = name.split("/", 1)[0]
        if part in DERIVED_PARTS and not (path / part).exists():
            continue
        if (why := _file_damage(path, name, size)) is not None:
            return why
    return None


def _file_damage(path: Path, name: str, size: int) -> str | None:
    found = path / name
    if not contained(path, found):
        return f"{MANIFEST_FILE} names {name!r}, outside the checkpoint"
    if not found.is_file():
        return f"{name} missing"
    actual = found.stat().st_size
    if actual < size:
        return f"{name} truncated ({actual} of {size} bytes)"
    if actual != size:
        return f"{name} has {actual} bytes, {MANIFEST_FILE} says {size}"
    return None


def _damage_without_manifest(path: Path) -> str | None:
    """A checkpoint written before manifests: state.json and the trainer's mark suffice."""
    if not (path / STATE_FILE).is_file():
        return f"unfinished (no {STATE_FILE}: its save was interrupted)"
    if (why := state_damage(path)) is not None:
        return why
    if not any(_non_empty(path / mark) for mark in TRAINER_MARKS):
        return f"{' or '.join(TRAINER_MARKS)} missing"
    return None


def _non_empty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def state_damage(path: Path) -> str | None:
    """Why ``state.json`` of ``path`` cannot be used (missing, empty, not JSON, no step)."""
    try:
        text = (path / STATE_FILE).read_text()
    except FileNotFoundError:
        return f"{STATE_FILE} missing"
    if not text.strip():
        return f"{STATE_FILE} empty"
    try:
        state = json.loads(text)
    except ValueError as error:
        return f"{STATE_FILE} is not JSON ({error})"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return f"{STATE_FILE} has no step number"
    return None


def has_manifest(path: Path) -> bool:
    return (path / MANIFEST_FILE).is_file()


def finished(path: Path) -> bool:
    """Whether a save of ``path`` got as far as its run state (loadable or not now)."""
    return (path / STATE_FILE).exists() or has_manifest(path)


def read_state(path: Path) -> dict[str, Any]:
    """``state.json`` of a checkpoint that :func:`damage` passed."""
    return json.loads((path / STATE_FILE).read_text())


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_N`` directory inside ``root`` (loadable or not),
    oldest first; entries that resolve outside ``root`` are named and left out."""
    if not root.is_dir():
        return []
    found = []
    for child in inside(root, root.iterdir(), what="checkpoint"):
        if (match := _STEP_DIR.match(child.name)) and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every loadable checkpoint under ``root``, oldest first."""
    return [(step, path) for step, path in step_dirs(root) if damage(path) is None]


def newest(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest loadable checkpoint and its state, or None (silent; ``--resume`` uses
    :func:`rl_launcher.infra.resume_choice.choose`, which says what it skipped)."""
    done = complete_checkpoints(root)
    if not done:
        return None
    path = done[-1][1]
    return path, read_state(path)


def prune(root: Path, keep_last: int) -> None:
    """Delete loadable checkpoints older than the newest ``keep_last`` loadable ones; a
    damaged or unfinished directory is neither counted nor deleted."""
    for _, path in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
