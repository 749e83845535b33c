"""Start-up pieces that cut a small run's wall time (issue 21): the training ranks start
on a worker thread while the engines start on the main thread, and the OMP_NUM_THREADS
rl-train was started with reaches every CPU training rank."""

import threading
import time

import pytest

from rl_launcher.roles.train_group import cpu_threads_env
from rl_launcher.session.start import beside


def test_build_runs_on_another_thread_while_meanwhile_runs_here(capsys):
    threads, order = {}, []

    def build():
        threads["build"] = threading.current_thread()
        time.sleep(0.2)  # still building when meanwhile ends
        order.append("built")
        return "trainer"

    def meanwhile():
        threads["meanwhile"] = threading.current_thread()
        order.append("engines")

    assert beside(build, meanwhile, what="trainer ready", show=True) == "trainer"
    assert threads["meanwhile"] is threading.main_thread()
    assert threads["build"] is not threading.main_thread()
    assert order == ["engines", "built"]  # both ran at once; the result waited for build
    assert capsys.readouterr().out.startswith("rl-train: trainer ready in 0.")


def test_without_meanwhile_build_runs_here():
    assert beside(threading.current_thread, None, what="x", show=False) is threading.main_thread()


def test_a_failed_build_is_raised_after_meanwhile_ran():
    ran = []

    def build():
        raise RuntimeError("rank 0 died")

    with pytest.raises(RuntimeError, match="rank 0 died"):
        beside(build, lambda: ran.append(1), what="x", show=False)
    assert ran == [1]


def test_when_both_fail_meanwhiles_error_is_raised_with_builds_as_cause():
    def build():
        raise RuntimeError("rank 0 died")

    def meanwhile():
        raise ValueError("engine exited")

    with pytest.raises(ValueError, match="engine exited") as info:
        beside(build, meanwhile, what="x", show=False)
    assert str(info.value.__cause__) == "rank 0 died"


def test_started_with_threads_go_to_every_rank(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert cpu_threads_env(1, "1")["env_vars"] == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    assert cpu_threads_env(16, "3")["env_vars"]["OMP_NUM_THREADS"] == "3"
    assert cpu_threads_env(3, None)["env_vars"]["OMP_NUM_THREADS"] == "2"  # the share
