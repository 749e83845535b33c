"""The stop-signal rules of rl_launcher.infra.stopping without Ray: real signals sent to this
process (handlers run in the main thread, as in rl-train) and, for the second signal that
exits at once, to a child process. The real rl-train, with Ray, is in
test_stop_signals.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rl_launcher.config import TrainConfig
from rl_launcher.infra import checkpoints, stopping

GRACE_S = 0.3


@pytest.fixture
def handlers():
    stopping.install(GRACE_S)
    yield
    stopping.uninstall()


def a_run(tmp_path, *, num_steps: int = 10, save_on_stop: bool = True):
    config = TrainConfig()
    config.num_steps, config.checkpoint.save_on_stop = num_steps, save_on_stop
    config.logging.run_dir = str(tmp_path / "run")
    return SimpleNamespace(config=config, extras={})


def test_a_signal_during_start_up_stops_at_once(handlers):
    start = time.monotonic()
    with pytest.raises(stopping.RunInterrupted) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # start-up work: interrupted
    assert time.monotonic() - start < 5
    assert (stop.value.exit_code, stop.value.step, stop.value.abandoned) == (143, 0, 0)


def test_a_step_that_trains_finishes_then_is_saved_and_the_run_stops(tmp_path, handlers, capfd):
    run, saved = a_run(tmp_path), []

    def save(run, step):
        saved.append(step)

    stepping = stopping.stepping(run, save, first_step=3)
    with pytest.raises(stopping.RunInterrupted) as stop, stepping:
        for step in range(3, 10):
            if step == 4:
                os.kill(os.getpid(), signal.SIGINT)  # while step 4 trains
            time.sleep(3 * GRACE_S)  # training outlasts the grace: never abandoned
            stopping.at_boundary(run, step, save, saved=False)
    assert saved == [4]
    assert (stop.value.exit_code, stop.value.step, stop.value.abandoned) == (130, 4, 0)
    err = capfd.readouterr().err
    assert "rl-train: SIGINT: stopping after this step" in err
    assert "past its rollout (training, weight sync or saving): it finishes first" in err


@pytest.mark.parametrize("save_on_stop", [True, False])
def test_a_step_still_generating_after_the_grace_is_abandoned(tmp_path, handlers, save_on_stop):
    run, saved = a_run(tmp_path, save_on_stop=save_on_stop), []

    def save(run, step):
        saved.append(step)

    start = time.monotonic()
    stepping = stopping.stepping(run, save, first_step=1)
    with pytest.raises(stopping.RunInterrupted) as stop, stepping:
        stopping.at_boundary(run, 1, save, saved=False)
        stopping.at_boundary(run, 2, save, saved=True)  # an interval checkpoint
        stopping.at_boundary(run, 3, save, saved=False)
        with stopping.generating(4):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # a rollout that does not end
    assert time.monotonic() - start < 10
    assert saved == ([3] if save_on_stop else [])  # the last completed step, not step 4
    assert (stop.value.exit_code, stop.value.step, stop.value.abandoned) == (143, 3, 4)


def test_no_stop_at_the_last_step_or_after_the_steps(tmp_path, handlers):
    run, saved = a_run(tmp_path, num_steps=2), []
    with stopping.stepping(run, lambda run, step: saved.append(step), first_step=1):
        stopping.at_boundary(run, 1, None, saved=False)
        os.kill(os.getpid(), signal.SIGTERM)
        stopping.at_boundary(run, 2, None, saved=True)  # the run is done anyway
    time.sleep(3 * GRACE_S)  # the grace alarm was cancelled with the steps
    assert saved == []


def test_a_first_signal_after_the_steps_lets_the_run_finish(tmp_path, handlers, capfd):
    with stopping.stepping(a_run(tmp_path), None, first_step=1):
        pass
    os.kill(os.getpid(), signal.SIGTERM)  # charts and cleanup go on
    time.sleep(0.1)
    assert "SIGTERM: the run is finishing (a second signal exits at once)" in capfd.readouterr().err


def test_uninstall_restores_the_handlers_found():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    stopping.install(1.0)
    assert signal.getsignal(signal.SIGTERM) is stopping._on_signal
    stopping.uninstall()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


SECOND_SIGNAL = """
import os, signal, subprocess, sys, time
from types import SimpleNamespace
from rl_launcher.config import TrainConfig
from rl_launcher.infra import stopping

stopping.install(60.0)
server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # an engine
run = SimpleNamespace(config=TrainConfig(), extras={})
with stopping.stepping(run, None, first_step=1):
    os.kill(os.getpid(), signal.SIGTERM)  # stop after this step: it trains on
    print(server.pid, flush=True)
    time.sleep(60)  # a step that hangs: the second signal must end the process
sys.exit("not reached")
"""


def test_a_second_signal_exits_at_once_with_the_processes_it_started():
    child = subprocess.Popen(
        [sys.executable, "-c", SECOND_SIGNAL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    server = int(child.stdout.readline())
    start = time.monotonic()
    child.send_signal(signal.SIGINT)
    code = child.wait(30)
    assert code == 130 and time.monotonic() - start < 5
    deadline = time.monotonic() + 5  # SIGKILLed; its zombie goes once init reaps it
    while Path(f"/proc/{server}").exists() and time.monotonic() < deadline:
        state = Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{server}").exists() or state == "Z"
    err = child.stderr.read()
    assert "rl-train: SIGTERM: stopping after this step" in err
    assert "rl-train: second signal (SIGINT): exiting now, without a checkpoint" in err


def test_stopped_message_names_the_step_and_the_last_checkpoint(tmp_path):
    config = a_run(tmp_path).config
    stop = stopping.RunInterrupted(signal.SIGTERM, step=2, abandoned=3)
    assert stopping.stopped_message(config, stop) == (
        "stopped at step 2 (step 3 abandoned while generating); no checkpoint yet: --resume "
        "would start again at step 1 (SIGTERM)"
    )
    path = checkpoints.step_path(checkpoints.checkpoint_dir(config), 2)
    path.mkdir(parents=True)
    checkpoints.write_state(path, {"step": 2})
    assert stopping.stopped_message(config, stop) == (
        "stopped at step 2 (step 3 abandoned while generating); last checkpoint step 2; "
        f"continue with --resume (SIGTERM; {path})"
    )
    before = stopping.RunInterrupted(signal.SIGINT)
    assert stopping.stopped_message(config, before).startswith("stopped before step 1; last")
