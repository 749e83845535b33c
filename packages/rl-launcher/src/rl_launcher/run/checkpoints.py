"""Run checkpoints: ``<dir>/step_000010/{trainer/, state.json}``.

The trainer part (model, optimizer, scheduler, RNG, step) is written by the backend; the
run part (step, weight version, data position) goes into ``state.json`` last, written to
a temporary name and renamed, so a checkpoint counts as complete only once its
``state.json`` exists. Older checkpoints beyond ``keep_last`` are removed.
"""

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from rl_launcher.paths import contained, inside

STATE_FILE = "state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(config) -> Path:
    return Path(config.checkpoint.dir or Path(config.logging.run_dir) / "checkpoints")


def step_path(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Mark ``path`` complete with the run state (atomic rename)."""
    tmp = path / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path / STATE_FILE)


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in inside(root, root.iterdir(), what="checkpoint"):
        match = _STEP_DIR.match(child.name)
        if match and (child / STATE_FILE).is_file() and contained(root, child / STATE_FILE):
            found.append((int(match.group(1)), child))
    return sorted(found)


def newest(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete checkpoint and its state, or None."""
    done = complete_checkpoints(root)
    if not done:
        return None
    path = done[-1][1]
    return path, json.loads((path / STATE_FILE).read_text())


def prune(root: Path, keep_last: int) -> None:
    for _, path in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
