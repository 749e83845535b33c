"""A pids cgroup per sandboxed test, where we may make one (root with the pids controller
mounted, as in most containers): the process limit holds even for root, whom
``RLIMIT_NPROC`` does not bind, and every process of the test is killed at the end, even
one that left its session with ``setsid``.

    jail = PidsJail.create(max_processes=64)    # None where cgroups are not writable
    Popen(..., preexec_fn=jail.enter)           # in the child, before exec
    jail.close()                                # SIGKILL whatever is left, remove the cgroup
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

_ROOTS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))  # cgroup v1, then v2


def _pids_root() -> Path | None:
    for root in _ROOTS:
        if (root / "pids.max").exists() or (root / "cgroup.procs").exists():
            v2_without_pids = root == _ROOTS[1] and "pids" not in _read(root / "cgroup.controllers")
            if not v2_without_pids and os.access(root, os.W_OK):
                return root
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class PidsJail:
    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def create(cls, max_processes: int) -> PidsJail | None:
        root = _pids_root()
        if root is None:
            return None
        path = root / f"rl-rewards-{uuid.uuid4().hex[:12]}"
        try:
            path.mkdir()
            (path / "pids.max").write_text(str(max_processes))
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            return None
        return cls(path)

    def enter(self) -> None:
        """Move the calling process (the forked child) into the cgroup."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        """Live processes in the cgroup (zombies waiting for their reaper do not count)."""
        pids = [int(p) for p in _read(self.path / "cgroup.procs").split()]
        return [p for p in pids if _read(Path(f"/proc/{p}/stat")).rpartition(")")[2][:3] != " Z "]

    def close(self) -> None:
        """Kill every process still in the cgroup (retrying while a fork races), remove it."""
        deadline = time.monotonic() + 5
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        with contextlib.suppress(OSError):
            self.path.rmdir()
