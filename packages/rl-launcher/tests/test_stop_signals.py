"""A real ``rl-train`` (a subprocess with its own Ray, an embedded engine behind the real
sglang-router, the quickstart config shrunk) stopped by signals, refused a run directory
in use, and failing when it learns nothing. Two runs share the signal and lock cases, as
each start of Ray costs 10-20 s here:

1. A run whose reward fails on one label (``rollout.on_reward_error=skip``): its progress
   lines count the samples trained. While it runs, a second rl-train into its directory is
   refused at once (exit 2, naming the first one's pid and host). SIGTERM after step 1: the
   step in progress finishes, a checkpoint of it is written (``checkpoint.interval: 0``,
   so only the stop writes one), exit 143 with ``stopped at step N; last checkpoint step N;
   continue with --resume``, and no process of the run is left. Before, Ray's C++ handler
   took SIGTERM in the driver (``*** SIGTERM received``, SIGABRT, exit 134).
2. ``--resume`` continues from step N on the prompts an uninterrupted run trains on; then
   SIGINT to its whole process group (Ctrl-C in a terminal, which reaches Ray's own
   processes too) while step N + 2 waits for a reward that takes a minute: after
   ``checkpoint.stop_grace_s`` the step is abandoned, step N + 1 is saved with step N + 2's
   prompts as the ones to draw again, exit 130.

A third run, whose reward fails on every sample, stops with exit 1 after
``algorithm.max_empty_steps`` steps that trained nothing, each saying why.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_kill_resume import (  # noqa: F401 (marker: a fixture)
    MARKER,
    marker,
    processes_with,
    uninterrupted_order,
)
from test_train_loop import ROOT, shrunk

from rl_core.types import Sample
from rl_launcher.infra import checkpoints, data_order
from rl_launcher.infra.run_log import read_metrics

pytestmark = pytest.mark.integration
TESTS = Path(__file__).resolve().parent
NUM_STEPS = 3000  # never reached: the signals come after a few steps (a step takes ~0.07 s)
STOP_BOUND_S = 120  # from the signal to rl-train's exit: the step, the checkpoint, cleanup
REFUSE_BOUND_S = 60  # a refused rl-train: imports and config, no Ray (~5 s idle)
GONE_BOUND_S = 30  # until no process of the run is left


def arguments(run_dir: Path, *extra: str) -> list[str]:
    return shrunk(
        run_dir,
        "--num_steps",
        str(NUM_STEPS),
        "--checkpoint.interval",
        "0",
        "--rollout.reward_timeout_s",
        "null",
        "--rollout.on_reward_error",
        "skip",
        "--logging.progress",
        "true",
        *extra,
    )


def rl_train(run_dir: Path, marker, *extra: str, fail_on="", slow_on="") -> subprocess.Popen:  # noqa: F811
    """rl-train in its own process group; the reward failing_rewards.fails_on_labels raises
    on the labels ``fail_on`` and takes a minute on ``slow_on`` (comma-separated)."""
    token, ray_dir = marker
    env = {
        **os.environ,
        MARKER: token,
        "RAY_TMPDIR": str(ray_dir),
        "FAIL_ON_LABELS": fail_on,
        "SLOW_ON_LABELS": slow_on,
        "PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}",
    }
    log = open(log_path(run_dir), "ab")  # noqa: SIM115 (the child holds it)
    command = [sys.executable, "-m", "rl_launcher.cli", *arguments(run_dir, *extra)]
    return subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def log_path(run_dir: Path) -> Path:
    return run_dir.parent / f"{run_dir.name}.log"


def wait_for_step(run_dir: Path, step: int, process: subprocess.Popen, timeout_s=300) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(r["step"] >= step for r in records(run_dir)):
        assert process.poll() is None, log_path(run_dir).read_text()[-3000:]
        assert time.monotonic() < deadline, f"no step {step} after {timeout_s}s"
        time.sleep(0.1)


def records(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []


def stopped(process: subprocess.Popen, run_dir: Path, token: str) -> tuple[int, str, int]:
    """Exit status, console and last recorded step of a signalled run, once none of its
    processes is left."""
    code = process.wait(STOP_BOUND_S)
    all_gone(token)
    return code, log_path(run_dir).read_text(errors="replace"), records(run_dir)[-1]["step"]


def all_gone(token: str) -> None:
    deadline = time.monotonic() + GONE_BOUND_S  # engines, router and Ray end with the run
    while (left := processes_with(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in left]


def labels_by_prompt() -> dict[str, str]:
    path = ROOT / "examples/quickstart/data/train.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {f"{path.stem}:{i}": row["label"] for i, row in enumerate(rows)}


def test_sigterm_and_ctrl_c_stop_at_a_step_boundary_and_the_run_dir_has_one_owner(
    tmp_path,
    marker,  # noqa: F811
):
    token, _ = marker
    run_dir = tmp_path / "run"
    order, labels = uninterrupted_order(arguments(run_dir), NUM_STEPS), labels_by_prompt()
    fail_on = labels[order[0]["prompts"][0]]  # step 1 trains fewer than all its samples
    reward = ("--rollout.reward", "failing_rewards:fails_on_labels")
    first = rl_train(run_dir, marker, *reward, fail_on=fail_on)
    wait_for_step(run_dir, 1, first)

    start = time.monotonic()  # a second run into the same directory, while the first runs
    command = [sys.executable, "-m", "rl_launcher.cli", *arguments(run_dir, *reward)]
    env = {**os.environ, "PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}"}
    second = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=REFUSE_BOUND_S
    )  # the reward is imported (and checked) at load, before the run dir's lock
    assert second.returncode == 2, second.stderr[-2000:]
    assert time.monotonic() - start < REFUSE_BOUND_S and "Ray ready" not in second.stdout
    assert (
        f"is in use by another run (pid {first.pid} on host {socket.gethostname()}, started "
        in second.stderr
    )

    os.kill(first.pid, signal.SIGTERM)
    code, log, step = stopped(first, run_dir, token)
    assert code == 143, log[-3000:]
    assert (
        f"rl-train: stopped at step {step}; last checkpoint step {step}; continue with --resume"
        in log
    )
    assert "*** SIGTERM received" not in log and "Traceback" not in log
    done = checkpoints.complete_checkpoints(run_dir / "checkpoints")
    assert [s for s, _ in done] == [step] and 1 <= step < NUM_STEPS
    lines = {line.split(" | ")[0]: line for line in log.splitlines() if line.startswith("step ")}
    for record in records(run_dir):  # "trained k/16": the samples of groups without a failure
        prompts = order[record["step"] - 1]["prompts"]
        trained = 4 * sum(labels[p] != fail_on for p in prompts)
        assert record["train/num_samples"] == trained and record["rollout/num_samples"] == 16
        # every sample of a failing label's group failed: no two left to compare, dropped
        assert record["rollout/groups_dropped_reward_error"] == (16 - trained) / 4
        assert f" | trained {trained}/16 | " in lines[f"step {record['step']}/{NUM_STEPS}"]
    assert records(run_dir)[0]["train/num_samples"] < 16

    # --resume continues; Ctrl-C (SIGINT to the process group, Ray's processes included)
    # while step + 2 waits for a reward that takes a minute: abandoned after the grace
    slow = {labels[p] for p in order[step + 1]["prompts"]} - {
        labels[p] for p in order[step]["prompts"]
    }  # step + 1 is quick when it can be
    slow = slow or {labels[p] for p in order[step + 1]["prompts"]}
    grace = ("--checkpoint.stop_grace_s", "5", "--rollout.reward_timeout_s", "300")
    resumed = rl_train(
        run_dir,
        marker,
        *reward,
        *grace,
        "--resume",
        fail_on=fail_on,
        slow_on=",".join(sorted(slow)),
    )
    wait_for_step(run_dir, step + 1, resumed)
    start = time.monotonic()
    os.killpg(resumed.pid, signal.SIGINT)
    code, log, last = stopped(resumed, run_dir, token)
    assert code == 130, log[-3000:]
    assert time.monotonic() - start < 5 + STOP_BOUND_S - 60  # the slow reward was not awaited
    assert "Traceback" not in log  # the abandoned rollout was cancelled, not left to fail
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{step:06d}'} (step {step};" in log
    assert f"rl-train: step {step + 2} still generating after 5 s: abandoned" in log
    assert (
        f"rl-train: stopped at step {step + 1} (step {step + 2} abandoned while generating); "
        f"last checkpoint step {step + 1}; continue with --resume" in log
    )
    assert last == step + 1 and [r["step"] for r in records(run_dir)] == list(range(1, last + 1))
    assert data_order.read(run_dir) == order[:last]  # the prompts of an uninterrupted run
    done = checkpoints.complete_checkpoints(run_dir / "checkpoints")
    assert done[-1][0] == last
    state = checkpoints.read_state(done[-1][1])  # step + 2's prompts: drawn again on resume
    pending = [data_order.prompt_id(Sample.from_dict(p)) for p in state["pending_prompts"]]
    assert pending == order[step + 1]["prompts"]


def test_a_run_that_learns_nothing_fails_naming_the_cause(tmp_path, marker):  # noqa: F811
    token, _ = marker
    run_dir = tmp_path / "run"
    process = rl_train(
        run_dir,
        marker,
        "--rollout.reward",
        "failing_rewards:always_fails",
        "--algorithm.max_empty_steps",
        "2",
    )
    code = process.wait(300)
    log = log_path(run_dir).read_text(errors="replace")
    assert code == 1, log[-3000:]
    cause = (
        "(nothing learnt: of 16 samples, 16 whose reward failed, skipped under "
        "rollout.on_reward_error=skip (first: reward 'failing_rewards:always_fails' "
        "failed on sample "
    )
    assert f"step 1/{NUM_STEPS} | trained 0/16 {cause}" in log
    assert f"step 2/{NUM_STEPS} | trained 0/16 {cause}" in log and "step 3/" not in log
    stop = (
        "rl-train: stopped: 2 steps in a row up to step 2 trained no sample "
        "(algorithm.max_empty_steps=2); step 2: of 16 samples, 16 whose reward failed"
    )
    assert stop in log and "RuntimeError: no scorer for label" in log
    assert checkpoints.complete_checkpoints(run_dir / "checkpoints") == []
    # start-up said what it was doing, phase by phase, before the first step
    phases = [
        "rl-train: model and prompts ready in ",
        "rl-train: 1 embedded engine(s) loading while Ray starts",
        "rl-train: Ray ready in ",
        "rl-train: started in ",
        f"s; step 1/{NUM_STEPS} running",
        f"step 1/{NUM_STEPS} |",
    ]
    at = [log.index(phase) for phase in phases]
    assert at == sorted(at)
    for ready in (
        "trainer ready (fsdp, 1 rank(s)) in ",
        "1 embedded engine(s) and router ready in ",
    ):
        assert at[2] < log.index(f"rl-train: {ready}") < at[3]  # side by side, in either order
    all_gone(token)
