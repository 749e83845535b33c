"""One run per run directory (rl_launcher.infra.run_lock) with real processes holding the lock;
the refusal of a second real rl-train is in test_stop_signals.py."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from rl_launcher.infra.run_lock import LOCK_FILE, RunDirBusy, lock_run_dir

HOLD = """
import subprocess, sys, time
from rl_launcher.infra.run_lock import lock_run_dir
lock = lock_run_dir(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # an engine
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder(tmp_path):
    """A process holding tmp_path's lock, with a child of its own (as engines are)."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    child = int(process.stdout.readline())
    yield process, child
    for pid in (process.pid, child):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(10)


def test_a_second_run_is_refused_naming_the_holder(tmp_path, holder):
    process, _ = holder
    start = time.monotonic()
    with pytest.raises(RunDirBusy) as busy:
        lock_run_dir(tmp_path)
    assert time.monotonic() - start < 1  # at once, never waiting for the holder
    message = str(busy.value)
    assert message.startswith(
        f"logging.run_dir={str(tmp_path)!r} is in use by another run "
        f"(pid {process.pid} on host {socket.gethostname()}, started "
    )
    assert message.endswith("set logging.run_dir to another directory")
    assert isinstance(busy.value, ValueError)  # rl-train: exit 2


def test_a_killed_holder_never_blocks_the_next_run_even_with_children_alive(tmp_path, holder):
    process, child = holder
    os.kill(process.pid, signal.SIGKILL)
    process.wait(10)
    os.kill(child, 0)  # its child (an engine outliving the run) still runs
    lock = lock_run_dir(tmp_path)  # the kernel dropped the lock with the holder
    assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_FILE).read_text()
    lock.release()
    lock_run_dir(tmp_path).release()  # released: free again


def test_the_same_process_cannot_take_it_twice(tmp_path):
    lock = lock_run_dir(tmp_path)
    try:
        with pytest.raises(RunDirBusy, match=f"pid {os.getpid()} "):
            lock_run_dir(tmp_path)  # flock locks are per open file: two runs in one process
    finally:
        lock.release()
