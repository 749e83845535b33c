"""The directories a run writes to, made and write-tested before Ray starts.

An unwritable ``checkpoint.dir`` used to show at the first save, which with
``checkpoint.interval: 0`` comes after the whole run and loses the trained weights.
:func:`prepare_run_dirs` finds it in milliseconds instead. It is meant to run first, before
anything else touches the directories (a run-directory lock can be taken right after it).
"""

import tempfile
from pathlib import Path

from rl_launcher.infra.checkpoints import checkpoint_dir


def absolute_paths(config) -> None:
    """Make the paths that Ray workers open absolute, as the driver sees them: a relative
    path would be taken from each worker's own working directory, which on another node
    (or in a Ray job) is not the driver's."""
    config.logging.run_dir = _absolute(config.logging.run_dir)
    config.checkpoint.dir = _absolute(config.checkpoint.dir)
    config.engine.weight_sync_dir = _absolute(config.engine.weight_sync_dir)
    if config.model.path is not None and Path(config.model.path).exists():  # else named later
        config.model.path = _absolute(config.model.path)


def _absolute(path: str | None) -> str | None:
    return None if path is None else str(Path(path).absolute())


def run_dirs(config) -> dict[str, Path]:
    """``{option: directory}`` of every directory the run writes to."""
    dirs = {"logging.run_dir": Path(config.logging.run_dir)}
    if not config.rollout.rollout_only:  # a rollout-only run saves no checkpoints
        dirs["checkpoint.dir"] = checkpoint_dir(config)
    return dirs


def prepare_run_dirs(config) -> dict[str, Path]:
    """Create every run directory and write (then delete) a file in each; ValueError
    naming the option and the OS error when one cannot be made or written."""
    dirs = run_dirs(config)
    for option, path in dirs.items():
        if path.exists() and not path.is_dir():
            raise ValueError(f"{option}={str(path)!r} is a file; give a directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
                pass
        except OSError as error:
            raise ValueError(
                f"{option}={str(path)!r} is not a writable directory: "
                f"{error.strerror or error}{_filename(error)}"
            ) from None
    return dirs


def _filename(error: OSError) -> str:
    return f" ({error.filename})" if error.filename else ""
