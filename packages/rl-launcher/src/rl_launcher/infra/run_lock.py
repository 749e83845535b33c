"""One run owns its run directory: an OS lock on ``<logging.run_dir>/.lock``.

Two ``rl-train`` into the same directory used to both run, interleaving their
``metrics.jsonl`` records and overwriting each other's checkpoints. :func:`lock_run_dir`
takes ``fcntl.flock`` (exclusive, non-blocking) on the lock file for the run's life and
writes the holder into it (pid, host, start time); a second run is refused at once
(:class:`RunDirBusy`, a ValueError: ``rl-train`` exits with status 2 naming the holder).
The kernel drops the lock when the holding process dies, however it dies (SIGKILL, the
OOM killer), so a killed run never blocks the next; a stale file with an old holder
means nothing. The descriptor is not inherited by the run's child processes (Python opens
files close-on-exec), so an engine that outlives a killed run holds no lock.

On network file systems ``flock`` is as good as the mount's locking: NFSv4 carries it
between hosts, Lustre needs the ``flock`` mount option.
"""

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"


class RunDirBusy(ValueError):
    """Another live process holds the run directory's lock."""


class RunDirLock:
    """A held lock; :meth:`release` (or the process's end) lets the next run in."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor drops the flock

    def close(self) -> None:
        self.release()


def lock_run_dir(run_dir: str | Path) -> RunDirLock:
    """Hold ``run_dir``'s lock (the directory must exist); RunDirBusy naming the holder
    when another process has it."""
    path = Path(run_dir) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise RunDirBusy(
            f"logging.run_dir={str(run_dir)!r} is in use by another run ({holder}); wait "
            "for it to end or stop it, or set logging.run_dir to another directory"
        ) from None
    except OSError:
        os.close(fd)
        raise
    _write_holder(fd)
    return RunDirLock(path, fd)


def holder_record() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _write_holder(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder_record()) + "\n").encode(), 0)


def _read_holder(fd: int) -> str:
    """The holder in words; the file may be being written this very moment."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        record = {}
    if not record.get("pid"):
        return "its holder has not written its pid yet"
    return (
        f"pid {record['pid']} on host {record.get('host', '?')}, started "
        f"{record.get('started_at', '?')}"
    )
