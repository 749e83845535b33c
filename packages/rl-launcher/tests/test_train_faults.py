"""Training faults end to end: real Ray (started once for the module), two rl-fsdp ranks in
one gloo group, an embedded engine behind the real sglang-router; the quickstart config
shrunk to three steps.

One run meets the faults in turn: step 2's batch holds a NaN advantage on rank 0 only (both
ranks skip the update, the step is recorded as skipped); then training rank 1 is SIGKILLed
while step 2's checkpoint is being written. The run must stop within a bound, naming the
rank and the last complete checkpoint (step 1), and never take step 2's partial directory
for a checkpoint; ``--resume`` continues from step 1 with the same prompts for step 2.
"""

import contextlib
import dataclasses
import io
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_train_loop import shrunk

from rl_launcher.cli import main
from rl_launcher.infra import checkpoints, data_order
from rl_launcher.infra.run_log import read_metrics
from rl_launcher.loops import rl as loop
from rl_launcher.roles.train_group import TrainGroup

pytestmark = pytest.mark.integration
STOP_BOUND_S = 60.0  # from the SIGKILL to rl-train's return, cleanup included


@pytest.fixture(scope="module")
def ray_started():
    """One local Ray for the module (runs attach to it and leave it running)."""
    import ray

    from rl_launcher.infra.ray_cluster import connect

    assert connect(num_cpus=max(os.cpu_count() or 1, 4)) == "started"
    yield
    ray.shutdown()


def poison_step(monkeypatch, bad_step: int) -> None:
    """Give step ``bad_step`` (counted from the run's first) a NaN advantage on rank 0."""
    real, calls = loop.minibatches, []

    def poisoned(rank_batches, num_minibatches):
        calls.append(1)
        parts = real(rank_batches, num_minibatches)
        if len(calls) != bad_step:
            return parts
        first = parts[0][0]
        advantages = first.advantages.clone()
        advantages[int(first.loss_mask.nonzero()[0])] = float("nan")
        parts[0][0] = dataclasses.replace(first, advantages=advantages)
        return parts

    monkeypatch.setattr(loop, "minibatches", poisoned)


def kill_rank_while_saving(monkeypatch, *, step: int, rank: int, killed_at: list) -> None:
    """SIGKILL training rank ``rank``'s process once step ``step``'s trainer checkpoint
    has begun (its temporary directory exists)."""
    import ray

    real = TrainGroup.save

    def save(self, path: str) -> None:
        if f"step_{step:06d}" in path:
            pid = ray.get(self.workers[rank].__ray_call__.remote(lambda worker: os.getpid()))
            args = (Path(path + ".tmp"), pid, killed_at)
            threading.Thread(target=_kill_when_writing, args=args, daemon=True).start()
        return real(self, path)

    monkeypatch.setattr(TrainGroup, "save", save)


def _kill_when_writing(partial: Path, pid: int, killed_at: list) -> None:
    deadline = time.monotonic() + 120
    while not partial.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    killed_at.append(time.monotonic())


@pytest.fixture(scope="module")
def faulty_run(ray_started, tmp_path_factory):
    """The run with the faults, then its resume: what each left behind."""
    run_dir = tmp_path_factory.mktemp("faults") / "run"
    argv = shrunk(run_dir, "--cluster.devices_per_node", "2", "--checkpoint.interval", "1")
    killed_at: list[float] = []
    start = time.monotonic()
    with pytest.MonkeyPatch.context() as patch, _captured() as first_out:
        poison_step(patch, bad_step=2)
        kill_rank_while_saving(patch, step=2, rank=1, killed_at=killed_at)
        status = main(argv)
        stopped_after_s = time.monotonic() - killed_at[0]
    first = {
        "status": status,
        "stderr": first_out["err"],
        "stopped_after_s": stopped_after_s,
        "records": read_metrics(run_dir),
        "complete": [s for s, _ in checkpoints.complete_checkpoints(run_dir / "checkpoints")],
        "newest": checkpoints.newest(run_dir / "checkpoints"),
        "order": data_order.read(run_dir),
        "step2_dir": sorted(p.name for p in (run_dir / "checkpoints/step_000002").iterdir()),
    }
    print(
        f"faulty run: {time.monotonic() - start:.0f} s, stopped {stopped_after_s:.1f} s "
        "after the kill"
    )
    start = time.monotonic()
    with _captured() as resumed_out:
        resumed = {"status": main([*argv, "--resume"])}
    print(f"resumed run: {time.monotonic() - start:.0f} s")
    resumed["stdout"] = resumed_out["out"]
    resumed["records"], resumed["order"] = read_metrics(run_dir), data_order.read(run_dir)
    resumed["complete"] = [s for s, _ in checkpoints.complete_checkpoints(run_dir / "checkpoints")]
    return run_dir, first, resumed


@contextlib.contextmanager
def _captured():
    """``{"out": ..., "err": ...}`` printed by the code inside (module fixtures have no
    capsys), echoed afterwards for the test log."""
    out, err, text = io.StringIO(), io.StringIO(), {}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield text
    finally:
        text["out"], text["err"] = out.getvalue(), err.getvalue()
        print(text["out"]), print(text["err"], file=sys.stderr)


def test_nonfinite_step_is_skipped_recorded_and_warned(faulty_run):
    _, first, _ = faulty_run
    assert [r["step"] for r in first["records"]] == [1, 2]
    # one of step 2's four minibatch updates held the NaN: that one was skipped
    assert [r["train/nonfinite_skipped"] for r in first["records"]] == [0.0, 1.0]
    assert first["records"][1]["train/nonfinite_loss"] is None  # NaN, stored as null
    warning = "step 2: 1 of 4 minibatch updates skipped for a non-finite loss (nan)"
    assert warning in first["stderr"]
    assert "1 such step(s) in a row, the run stops at 3" in first["stderr"]


def test_killed_rank_stops_the_run_promptly_naming_rank_and_checkpoint(faulty_run):
    run_dir, first, _ = faulty_run
    assert first["status"] == 1
    assert first["stopped_after_s"] < STOP_BOUND_S
    message = first["stderr"]
    assert "rl-train: stopped: training rank 1 (its Ray actor, on node " in message
    assert ") died during save" in message
    step1 = run_dir / "checkpoints" / "step_000001"
    assert f"last complete checkpoint: {step1} (step 1); continue with --resume" in message


def test_partial_checkpoint_is_never_taken_for_a_complete_one(faulty_run):
    run_dir, first, _ = faulty_run
    assert first["complete"] == [1]
    assert checkpoints.STATE_FILE not in first["step2_dir"]  # begun, never completed
    assert first["newest"][0] == run_dir / "checkpoints" / "step_000001"


def test_resume_continues_from_the_last_complete_checkpoint(faulty_run):
    run_dir, first, resumed = faulty_run
    assert resumed["status"] == 0
    assert f"resumed from {run_dir / 'checkpoints' / 'step_000001'}" in resumed["stdout"]
    assert [r["step"] for r in resumed["records"]] == [1, 2, 3]
    assert [r["train/nonfinite_skipped"] for r in resumed["records"]] == [0.0, 0.0, 0.0]
    assert all(torch.isfinite(torch.tensor(r["loss/total"])) for r in resumed["records"])
    assert resumed["order"][:2] == first["order"][:2]  # step 2 redone on the same prompts
    assert resumed["complete"] == [2, 3]
