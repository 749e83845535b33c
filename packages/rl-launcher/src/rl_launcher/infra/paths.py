"""Path containment: what a run reads back from its own directories (checkpoints, rollout
dumps) must lie inside them once every symlink is resolved, so a planted link cannot make
``--resume`` or a replay read, or ``prune`` delete, anything outside what the user gave."""

import sys
from collections.abc import Iterable
from pathlib import Path


def contained(root: str | Path, path: str | Path) -> bool:
    """Whether ``path`` (symlinks resolved) is ``root`` or lies under it."""
    return Path(path).resolve().is_relative_to(Path(root).resolve())


def inside(root: str | Path, paths: Iterable[Path], *, what: str) -> list[Path]:
    """``paths`` that stay inside ``root``; each one that leaves it is named on stderr."""
    kept = []
    for path in paths:
        if contained(root, path):
            kept.append(path)
        else:
            print(
                f"rl-train: ignoring {what} {path}: it resolves to {Path(path).resolve()}, "
                f"outside {root}",
                file=sys.stderr,
            )
    return kept
