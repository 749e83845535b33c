"""``rl-train`` killed with SIGKILL mid-run (the whole process group, after a checkpoint),
then ``--resume``d, trains on exactly the prompts an uninterrupted run trains on, step by
step, and leaves no engine, router or Ray process behind. Runs are real subprocesses with
their own Ray (in a private temp dir), in the one-step-async loop, whose checkpoints must
also carry the prompts of the rollout in flight.

An uninterrupted run trains on the prompt stream in draw order, ``batch_size`` prompts a
step (test_loops.py checks it on a real run of each loop); the resumed run is compared
with that stream rather than with a third full run, to keep CI short."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from test_train_loop import shrunk

from rl_launcher.config.loader import load_config
from rl_launcher.data import build_prompt_source
from rl_launcher.infra import data_order
from rl_launcher.infra.run_log import read_metrics
from rl_launcher.session.model import load_tokenizer

pytestmark = pytest.mark.integration
MARKER = "RL_LAUNCHER_KILL_TEST"
NUM_STEPS = 5


@pytest.fixture
def marker():
    """Every process of these runs inherits MARKER=<token>; none may outlive the test."""
    token = uuid.uuid4().hex
    ray_dir = Path(tempfile.mkdtemp(prefix="rlk", dir="/tmp"))  # short: Ray's socket paths
    yield token, ray_dir
    for pid in processes_with(token):  # only if the test failed: do not leak them
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(ray_dir, ignore_errors=True)


def processes_with(token: str) -> list[int]:
    """Live processes whose environment holds MARKER=token (this user's only)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            ours = f"{MARKER}={token}".encode() in (entry / "environ").read_bytes().split(b"\0")
            if ours and (entry / "stat").read_text().split(") ")[1][0] != "Z":  # not a zombie
                found.append(int(entry.name))
        except OSError:  # exited meanwhile, or not ours
            continue
    return found


def arguments(run_dir: Path, *extra: str) -> list[str]:
    return shrunk(
        run_dir,
        "--num_steps",
        str(NUM_STEPS),
        "--rollout.loop",
        "one_step_async",
        "--logging.progress",
        "true",
        *extra,
    )


def uninterrupted_order(argv: list[str], num_steps: int) -> list[dict]:
    """The data-order records an uninterrupted run of ``argv`` writes over ``num_steps``
    steps: its prompt stream, step by step."""
    config, _ = load_config(argv)
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    source = build_prompt_source(config.data, seed=config.seed, tokenizer=tokenizer)
    size, records = config.rollout.batch_size, []
    for step in range(1, num_steps + 1):
        prompts = [source.next_prompt() for _ in range(size)]
        records.append(
            {
                "step": step,
                "prompts": [data_order.prompt_id(p) for p in prompts],
                "draws": [p.group_index for p in prompts],
            }
        )
    return records


def rl_train(run_dir: Path, marker, *extra: str) -> subprocess.Popen:
    token, ray_dir = marker
    env = {**os.environ, MARKER: token, "RAY_TMPDIR": str(ray_dir)}
    args = arguments(run_dir, *extra)
    log = open(run_dir.parent / f"{run_dir.name}.log", "ab")  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(
        [sys.executable, "-m", "rl_launcher.cli", *args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(process: subprocess.Popen, run_dir: Path, timeout_s: float = 300) -> None:
    code = process.wait(timeout_s)
    log = (run_dir.parent / f"{run_dir.name}.log").read_text(errors="replace")
    assert code == 0, log[-3000:]


def wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, f"rl-train exited with {process.returncode}"
        assert time.monotonic() < deadline, f"no {path} after {timeout_s}s"
        time.sleep(0.05)


def test_sigkill_then_resume_trains_on_the_same_prompts(tmp_path, marker):
    token, _ = marker
    killed = tmp_path / "killed"
    process = rl_train(killed, marker)
    wait_for(killed / "checkpoints" / "step_000002" / "state.json", process)
    os.killpg(process.pid, signal.SIGKILL)  # rl-train and everything in its group
    process.wait(30)
    assert_all_gone(token, within_s=30)  # engines, router and Ray die with the run
    finish(rl_train(killed, marker, "--resume"), killed)
    assert [r["step"] for r in read_metrics(killed)] == list(range(1, NUM_STEPS + 1))
    assert data_order.read(killed) == uninterrupted_order(arguments(killed), NUM_STEPS)
    # a clean exit leaves nothing either; helpers that notice their parent's exit through a
    # closed pipe (multiprocessing's forkserver, the reward pool) go within moments
    assert_all_gone(token, within_s=10)


def assert_all_gone(token: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while (left := processes_with(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], [Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in left]
