"""Faults the FSDP backend survives, with real gloo process groups and real processes:

- NaN / inf in the loss or gradients on one rank: every rank skips the update, parameters,
  AdamW state, schedule and step stay bit-identical, and the next good step trains exactly
  as if the bad steps had never been fed (2 spawned ranks).
- SIGKILL in the middle of a checkpoint save that overwrites an earlier one: the earlier
  checkpoint is what a fresh process loads, bit-identical.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import fsdp_faults_worker
import pytest
import torch
import torch.multiprocessing as mp

from rl_core.distributed import free_port
from rl_fsdp.checkpoint import TRAINER_STATE

pytestmark = pytest.mark.integration
WORKER = Path(fsdp_faults_worker.__file__)
KILL_POINTS = ("writing", "swapping")


def test_nonfinite_steps_are_skipped_on_every_rank(nonfinite):
    for rank in nonfinite:  # the NaN was on rank 1 only, the inf on rank 0 only
        nan_step, inf_step = rank["bad"]
        assert nan_step["train/nonfinite_skipped"] == inf_step["train/nonfinite_skipped"] == 1.0
        assert math.isnan(nan_step["loss/total"]) and not math.isfinite(inf_step["loss/total"])
        assert not math.isfinite(nan_step["train/grad_norm"])
        assert [s["train/step"] for s in rank["bad"]] == [1.0, 1.0]  # no optimizer step


def test_skipped_steps_leave_parameters_and_optimizer_state_bit_identical(nonfinite):
    for rank in nonfinite:
        assert rank["untouched"] and rank["grads_dropped"]


def test_a_good_step_after_skips_trains_as_if_they_never_happened(nonfinite):
    for rank in nonfinite:
        assert rank["moved_by_good_step"] and rank["same_as_reference"]
        got, expected = rank["good"][1], rank["expected"][1]
        assert got["train/nonfinite_skipped"] == 0.0 and got["train/step"] == 2.0
        for key in ("loss/total", "train/grad_norm", "train/lr"):
            assert got[key] == expected[key], key  # the schedule did not advance either


def _python_env() -> dict:
    tests = str(WORKER.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}


def _start_save(workdir: Path, point: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), str(workdir), point], env=_python_env())


def _kill_when_blocked(proc: subprocess.Popen, workdir: Path) -> None:
    deadline = time.monotonic() + 300
    while not (workdir / "blocked").exists():
        assert proc.poll() is None, f"the saving process exited early ({proc.returncode})"
        assert time.monotonic() < deadline, "the save never reached its kill point"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Saves SIGKILLed at each point (side by side), then one 2-rank job that runs the
    non-finite checks and loads what survived each kill."""
    dirs = {point: tmp_path_factory.mktemp(point) for point in KILL_POINTS}
    procs = {point: _start_save(dirs[point], point) for point in KILL_POINTS}
    try:
        for point, proc in procs.items():
            _kill_when_blocked(proc, dirs[point])
    finally:
        for proc in procs.values():
            proc.kill()
    layouts = {p: sorted(child.name for child in d.iterdir()) for p, d in dirs.items()}
    workdir = tmp_path_factory.mktemp("job")
    killed = [str(dirs[point]) for point in KILL_POINTS]
    pristine = tmp_path_factory.mktemp("pristine")
    for point in KILL_POINTS:
        shutil.copytree(dirs[point], pristine / point)
    try:
        mp.spawn(fsdp_faults_worker.run, args=(2, free_port(), str(workdir), killed), nprocs=2)
    except mp.ProcessExitedException as died:
        # Seen twice under CI load: a rank aborting at start-up ("terminate called without
        # an active exception", cause not found yet; the worker prints every thread's stack
        # on SIGABRT). One more run on a fresh port, from the same killed checkpoints.
        warnings.warn(f"the 2-rank job died ({died}); running it once more", stacklevel=1)
        for point in KILL_POINTS:
            shutil.rmtree(dirs[point])
            shutil.copytree(pristine / point, dirs[point])
        mp.spawn(fsdp_faults_worker.run, args=(2, free_port(), str(workdir), killed), nprocs=2)
    return torch.load(workdir / "nonfinite.pt", weights_only=False), dirs, layouts


@pytest.fixture
def nonfinite(job):
    return job[0]


@pytest.fixture
def killed(job):
    return job[1:]


def test_kill_while_writing_keeps_the_previous_checkpoint_in_place(killed):
    dirs, layouts = killed
    workdir = dirs["writing"]
    assert "ckpt.tmp" in layouts["writing"] and "ckpt.old" not in layouts["writing"]
    assert not (workdir / "ckpt.tmp" / TRAINER_STATE).exists()  # partial: never complete
    assert json.loads((workdir / "loaded.json").read_text()) == {"step": 1, "same": True}


def test_kill_between_renames_falls_back_to_the_previous_checkpoint(killed):
    dirs, layouts = killed
    assert "ckpt" not in layouts["swapping"] and "ckpt.old" in layouts["swapping"]
    assert json.loads((dirs["swapping"] / "loaded.json").read_text()) == {"step": 1, "same": True}
