"""``rl-train`` as a Ray job, as docs/cluster.md and examples/cluster run it: a head started
with ``ray start --head`` (its own ports and temp dir), then ``ray job submit --working-dir
<dir> -- rl-train --config config.yaml --num_steps 2`` through the head's dashboard. The
job's entrypoint finds the cluster through RAY_ADDRESS, which Ray sets for it; the run
succeeds and records both steps.

Needs ``ray[default]`` (the dashboard's job server): skipped without it. tox's ``rayjob``
environment runs it (``uv sync --package rl-launcher --group rayjob``); the ``launcher``
environment keeps plain ``ray``, where every Ray start stays light.

The head runs under ``ray start --block`` in a process group of its own, stopped by
signalling that group: ``ray stop`` would stop every Ray on this machine, not only this one.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from test_train_loop import QUICKSTART, ROOT

from rl_launcher.infra.run_log import read_metrics
from rl_sglang.process import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BIN = Path(sys.executable).parent  # `ray` and `rl-train` of this environment


def job_server_missing() -> str | None:
    """Why ``ray job submit`` cannot run here, or None."""
    try:
        from ray._private.utils import get_dashboard_dependency_error
    except ImportError as error:  # a Ray without the helper
        return f"cannot tell whether ray[default] is installed: {error}"
    if (error := get_dashboard_dependency_error()) is not None:
        return (
            f"`ray job submit` needs ray[default] (the dashboard's job server): {error}; "
            "run it with `tox -e rayjob`"
        )
    if not (BIN / "ray").exists() or not (BIN / "rl-train").exists():
        return f"no `ray` / `rl-train` command beside {sys.executable}"
    return None


def job_config(folder: Path, run_dir: Path) -> Path:
    """The quickstart shrunk to 4 prompts x 4 samples, its paths absolute (the job runs in
    a copy of the working directory)."""
    config = yaml.safe_load(QUICKSTART.read_text())
    config["model"]["tokenizer_path"] = str(ROOT / "examples/quickstart/tokenizer")
    config["data"]["train"][0]["path"] = str(ROOT / "examples/quickstart/data/train.jsonl")
    config["rollout"] |= {"batch_size": 4, "group_size": 4}
    config["logging"]["run_dir"] = str(run_dir)
    config["checkpoint"]["interval"] = 2
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def ray_head(temp_dir: Path, env: dict, attempts: int = 3):
    """A Ray head of 2 CPUs on free ports; yields its dashboard's address and GCS port.
    A start that fails is tried again: the raylet gives the dashboard agent 15 s to report
    its port and aborts when a loaded machine makes it late."""
    for attempt in range(1, attempts + 1):
        head, address, port = start_head(temp_dir / f"attempt{attempt}", env)
        if wait_for_dashboard(head, address):
            break
        stop_group(head)
        log = (temp_dir / f"attempt{attempt}" / "head.log").read_text()
        assert attempt < attempts, f"no Ray head after {attempts} attempts:\n{log[-3000:]}"
    try:
        yield address, port
    finally:
        stop_group(head)


def start_head(folder: Path, env: dict) -> tuple[subprocess.Popen, str, int]:
    """``ray start --head --block`` in its own process group; the process, the dashboard's
    address and the GCS port."""
    folder.mkdir(parents=True)
    port, dashboard = free_port(), free_port()
    command = [BIN / "ray", "start", "--head", "--block", "--port", str(port)]
    command += ["--dashboard-port", str(dashboard), "--dashboard-host", "127.0.0.1"]
    command += ["--num-cpus", "2", "--temp-dir", str(folder), "--disable-usage-stats"]
    head = subprocess.Popen(
        command,
        env=env,
        stdout=open(folder / "head.log", "wb"),  # noqa: SIM115 (the child holds it)
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its raylet, GCS and dashboard: one group to stop
    )
    return head, f"http://127.0.0.1:{dashboard}", port


def wait_for_dashboard(head: subprocess.Popen, address: str, timeout_s: float = 600) -> bool:
    """Whether the dashboard answers before ``ray start`` gives up."""
    deadline = time.monotonic() + timeout_s
    while not answers(f"{address}/api/version"):
        if head.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(1)
    return True


def answers(url: str) -> bool:
    """Whether an HTTP server answers at ``url``, with any status: a head with token
    authentication answers 401 to a request without the token."""
    try:
        with urllib.request.urlopen(url, timeout=30):  # a loaded dashboard is slow
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the process group (``ray start --block`` stops what it started), then
    SIGKILL what is left of it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(30)


def test_rl_train_runs_as_a_ray_job(tmp_path):
    if (reason := job_server_missing()) is not None:
        pytest.skip(reason)
    temp_dir = Path(tempfile.mkdtemp(prefix="rlj", dir="/tmp"))  # short: Ray's socket paths
    work_dir, run_dir = tmp_path / "job", tmp_path / "run"
    work_dir.mkdir()
    job_config(work_dir, run_dir)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # the job's shell finds rl-train
    env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"  # every process uses this environment as is
    # Ray >= 2.60 turns token authentication on for a new head; the CLI sends the token
    # (~/.ray/auth_token) only when told to
    env["RAY_AUTH_MODE"] = "token"
    try:
        with ray_head(temp_dir, env) as (address, port):
            submit = [BIN / "ray", "job", "submit", "--address", address]
            submit += ["--submission-id", "rl-train-job", "--working-dir", str(work_dir), "--"]
            submit += ["rl-train", "--config", "config.yaml", "--num_steps", "2"]
            submitted = subprocess.run(
                submit,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            output = submitted.stdout + submitted.stderr
            status = subprocess.run(
                [BIN / "ray", "job", "status", "--address", address, "rl-train-job"],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert submitted.returncode == 0, output[-4000:]
    said = status.stdout + status.stderr  # Ray's job status: SUCCEEDED, said in words
    assert "Job 'rl-train-job' succeeded" in said, said + output[-3000:]
    # the job's rl-train attached to this head (RAY_ADDRESS), not a Ray of its own
    attached = [line for line in output.splitlines() if "Connecting to existing Ray" in line]
    assert attached and f":{port}" in attached[0], output[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
