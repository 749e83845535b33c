"""SIGKILL in the middle of a checkpoint save that overwrites an earlier one (a real
process, killed at two points): the earlier checkpoint is the one that loads, and a
partial directory never does."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ckpt_kill_job
import pytest
import torch

from rl_megatron import checkpoint

pytestmark = pytest.mark.integration
JOB = Path(ckpt_kill_job.__file__)
KILL_POINTS = ("writing", "swapping")


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict[str, Path]:
    """``{point: workdir}``: both saves start side by side; each is killed at its point."""
    dirs = {point: tmp_path_factory.mktemp(point) for point in KILL_POINTS}
    env = {**os.environ, "PYTHONPATH": str(JOB.parent)}
    procs = {
        p: subprocess.Popen([sys.executable, str(JOB), str(dirs[p]), p], env=env) for p in dirs
    }
    try:
        for point, proc in procs.items():
            deadline = time.monotonic() + 120
            while not (dirs[point] / "blocked").exists():
                assert proc.poll() is None, f"the save exited early ({proc.returncode})"
                assert time.monotonic() < deadline, "the save never reached its kill point"
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        for proc in procs.values():
            proc.kill()
    return dirs


def _loads_the_first_save(path: Path) -> None:
    state = checkpoint.load_sharded(path, ckpt_kill_job.META)
    assert state["step"] == 1
    assert torch.equal(state["model"]["w"], ckpt_kill_job.state(1)["model"]["w"])


def test_kill_while_writing_keeps_the_previous_checkpoint(killed):
    workdir = killed["writing"]
    partial = workdir / ".ckpt.partial"
    assert (partial / "rank_00000.pt").is_file() and not (partial / "meta.json").exists()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint.load_sharded(partial, ckpt_kill_job.META)
    _loads_the_first_save(workdir / "ckpt")


def test_kill_between_renames_falls_back_to_the_previous_checkpoint(killed):
    workdir = killed["swapping"]
    assert not (workdir / "ckpt").exists() and (workdir / ".ckpt.old" / "meta.json").is_file()
    _loads_the_first_save(workdir / "ckpt")


def test_the_next_save_after_a_kill_replaces_the_fallback(killed):
    workdir = killed["swapping"]
    checkpoint.save_sharded(workdir / "ckpt", ckpt_kill_job.state(3), ckpt_kill_job.META)
    assert checkpoint.load_sharded(workdir / "ckpt", ckpt_kill_job.META)["step"] == 3
    assert sorted(p.name for p in workdir.iterdir()) == ["blocked", "ckpt"]
