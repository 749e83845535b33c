"""``--resume`` after the newest checkpoint was damaged on disk, end to end: real Ray (one
start for the module), an rl-fsdp training actor, an embedded engine behind the real
sglang-router; the quickstart config shrunk to a few steps of the one-step-async loop
(whose checkpoints also carry the prompts of the rollout in flight).

A 3-step run checkpoints every step; then a shard of step 3's checkpoint is truncated.
``--resume`` must skip step 3 with one line saying why, load step 2, and train steps 3
and 4 on the prompts an uninterrupted run trains on. Then a checkpoint without a manifest
(as saved by an older version) whose shard is truncated fails to load with one line
naming it, not a Ray traceback."""

import re
import time

import pytest
from test_kill_resume import arguments, uninterrupted_order
from test_train_faults import ray_started  # noqa: F401 (the module's one Ray)

from rl_launcher.cli import main
from rl_launcher.infra import checkpoints, data_order
from rl_launcher.infra.run_log import read_metrics

pytestmark = pytest.mark.integration


def truncate_largest_shard(step_dir) -> str:
    """Halve the largest file of the trainer's checkpoint; returns its relative path."""
    shard = max((step_dir / "trainer").rglob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard.relative_to(step_dir).as_posix()


def test_resume_skips_a_damaged_newest_checkpoint_and_continues(tmp_path, capsys, ray_started):  # noqa: F811
    run_dir = tmp_path / "run"
    every_step = ("--checkpoint.interval", "1")
    assert main(arguments(run_dir, "--num_steps", "3", *every_step)) == 0
    root = run_dir / "checkpoints"
    assert [s for s, _ in checkpoints.complete_checkpoints(root)] == [2, 3]  # keep_last 2
    step2, step3 = checkpoints.step_path(root, 2), checkpoints.step_path(root, 3)
    shard = truncate_largest_shard(step3)
    capsys.readouterr()

    assert main(arguments(run_dir, "--num_steps", "4", *every_step, "--resume")) == 0
    out, err = capsys.readouterr()
    assert f"rl-train: checkpoint {step3}: {shard} truncated (" in err
    assert re.search(rf"checkpoint {step3}: .* bytes\); using step_000002\n", err)
    assert f"rl-train: resumed from {step2} (step 2;" in out
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert data_order.read(run_dir) == uninterrupted_order(arguments(run_dir), 4)  # as from step 2
    assert (root / "step_000003.damaged" / shard).is_file()  # kept aside, not deleted
    assert [s for s, _ in checkpoints.complete_checkpoints(root)] == [3, 4]

    step4 = checkpoints.step_path(root, 4)  # as an older version saved it: no manifest
    (step4 / checkpoints.MANIFEST_FILE).unlink()
    truncate_largest_shard(step4)
    assert main(arguments(run_dir, "--num_steps", "5", "--resume", "4")) == 2
    err = capsys.readouterr().err
    assert f"rl-train: checkpoint {step4} has no manifest.json" in err
    error = [line for line in err.splitlines() if line.startswith("rl-train: error:")]
    assert len(error) == 1, err[-3000:]
    assert error[0].startswith(f"rl-train: error: checkpoint {step4} could not be loaded: ")
    assert "RuntimeError: " in error[0] and "Traceback" not in error[0]  # the shard's error

    start = time.monotonic()  # a step without a checkpoint: refused before anything starts
    assert main(arguments(run_dir, "--resume", "7")) == 2
    assert time.monotonic() - start < 10
    assert capsys.readouterr().err.endswith(
        f"--resume 7: no checkpoint of step 7; loadable checkpoints in {root}: step 3, 4\n"
    )  # step 4's damage cannot be seen without its manifest
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]  # nothing rewritten
