"""Which checkpoint ``--resume`` loads, what a failed load says, and what becomes of the
checkpoints after it.

``checkpoint.resume``: ``true`` takes the newest loadable checkpoint under the run's
checkpoint directory (:func:`rl_launcher.infra.checkpoints.damage`); every newer one is
skipped with one line naming it and why (``checkpoint .../step_000020: trainer/dcp/
__0_0.distcp truncated (512 of 4096 bytes); using step_000010``). A step number or a
checkpoint directory picks that one; it is refused, naming it and what is wrong, when it
cannot be loaded. Any error while loading names the checkpoint (:func:`loading`). Once
one is loaded, the step directories after it are moved out of the way
(:func:`set_aside_after`): the resumed run redoes those steps.
"""

import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from rl_launcher.infra import checkpoints as ckpt


def chosen(config) -> tuple[Path, dict] | None:
    """The checkpoint ``config.checkpoint.resume`` names and its state (None when it is
    false, or true with no checkpoint yet); meant to run before the run starts anything."""
    if not config.checkpoint.resume:
        return None
    return choose(ckpt.checkpoint_dir(config), config.checkpoint.resume)


def choose(root: Path, target: bool | int | str = True) -> tuple[Path, dict] | None:
    """The checkpoint to resume from and its state. ``target``: true (the newest loadable
    one under ``root``; None when no save under ``root`` ever finished), a step number
    (int or digits) or a checkpoint directory. ValueError naming the checkpoint otherwise."""
    if target is True:
        return _newest(root)
    path = _named(root, target)
    if (why := ckpt.damage(path)) is not None:
        raise ValueError(f"checkpoint {path}: {why}; {_available(root)}")
    _note_without_manifest(path)
    return path, ckpt.read_state(path)


def _newest(root: Path) -> tuple[Path, dict] | None:
    skipped = []
    for _, path in reversed(ckpt.step_dirs(root)):
        if (why := ckpt.damage(path)) is None:
            _say_skipped(skipped, f"using {path.name}")
            _note_without_manifest(path)
            return path, ckpt.read_state(path)
        skipped.append((path, why))
    if any(ckpt.finished(path) for path, _ in skipped):  # saved once, damaged since
        listed = "; ".join(f"{path.name}: {why}" for path, why in skipped)
        raise ValueError(
            f"--resume: no loadable checkpoint in {root} ({listed}); repair one, or move them "
            "away to start again at step 1"
        )
    _say_skipped(skipped, "no earlier checkpoint")
    return None


def _named(root: Path, target: int | str) -> Path:
    """The directory of ``--resume STEP`` (a step under ``root``) or ``--resume PATH``."""
    if isinstance(target, int) or target.isdigit():
        path = dict(ckpt.step_dirs(root)).get(int(target))
        if path is None:
            raise ValueError(
                f"--resume {target}: no checkpoint of step {target}; {_available(root)}"
            )
        return path
    path = Path(target)
    if not path.is_dir():
        raise ValueError(
            f"--resume {target}: no such directory; give a step number or a checkpoint "
            f"directory ({_available(root)})"
        )
    if ckpt.step_dirs(path):
        raise ValueError(
            f"--resume {target}: a directory of checkpoints, not one; give one of them or a "
            f"step number ({_available(path)})"
        )
    return path


def _available(root: Path) -> str:
    steps = [str(step) for step, _ in ckpt.complete_checkpoints(root)]
    if not steps:
        return f"no loadable checkpoint in {root}"
    return f"loadable checkpoints in {root}: step {', '.join(steps)}"


def _say_skipped(skipped: list[tuple[Path, str]], outcome: str) -> None:
    for path, why in skipped:
        print(f"rl-train: checkpoint {path}: {why}; {outcome}", file=sys.stderr, flush=True)


def _note_without_manifest(path: Path) -> None:
    if not ckpt.has_manifest(path):
        print(
            f"rl-train: checkpoint {path} has no {ckpt.MANIFEST_FILE} (saved before "
            f"manifests existed, or stopped just before writing it): its {ckpt.STATE_FILE} "
            "parses and its trainer state is there, so it is used; file sizes cannot be "
            "checked",
            file=sys.stderr,
            flush=True,
        )


@contextlib.contextmanager
def loading(path: Path) -> Iterator[None]:
    """Errors while loading the checkpoint at ``path``, in the driver or on a training
    rank (a Ray task error, a rank that died), become a one-line ValueError naming it."""
    from ray.exceptions import RayError

    try:
        yield
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, RayError) as error:
        raise ValueError(f"checkpoint {path} could not be loaded: {_first_line(error)}") from error


def _first_line(error: BaseException, limit: int = 200) -> str:
    """``Type: first line`` (at most ``limit`` characters) of the error at the bottom of
    ``error``: the remote one of a Ray task error, the first rank's of a
    torch.distributed.checkpoint ``CheckpointException`` (whose own text is a traceback)."""
    error = _innermost(error)
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else "(no message)"
    line = line if len(line) <= limit else line[: limit - 3] + "..."
    return f"{type(error).__name__}: {line}"


def _innermost(error: BaseException) -> BaseException:
    cause = getattr(error, "cause", None)  # a Ray task error's remote exception
    if isinstance(cause, BaseException):
        return _innermost(cause)
    failures = getattr(error, "failures", None)  # {rank: (exception, frames)}
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        first = first[0] if isinstance(first, tuple) else first
        if isinstance(first, BaseException):
            return _innermost(first)
    return error


def set_aside_after(root: Path, step: int) -> None:
    """Move every step directory after ``step`` out of the resumed run's way, so that it
    neither mixes its files with theirs nor resumes from them later: an unfinished one
    (no save ever completed there) is deleted; a finished one is renamed
    ``step_N.damaged`` or ``step_N.superseded``, never deleted (delete it yourself)."""
    for later, path in ckpt.step_dirs(root):
        if later <= step:
            continue
        if not ckpt.finished(path):
            shutil.rmtree(path)
            continue
        kind = "superseded" if ckpt.damage(path) is None else "damaged"
        aside = _free_name(path, kind)
        path.rename(aside)
        print(
            f"rl-train: moved {path} ({kind}) to {aside.name}; the run redoes step {later}",
            file=sys.stderr,
            flush=True,
        )


def _free_name(path: Path, kind: str) -> Path:
    candidate, number = path.with_name(f"{path.name}.{kind}"), 1
    while candidate.exists():
        candidate, number = path.with_name(f"{path.name}.{kind}{number}"), number + 1
    return candidate
