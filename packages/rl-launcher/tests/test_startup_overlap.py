"""Start-up pieces that cut a small run's wall time (issue 21): the training ranks start
on a worker thread while the engines start on the main thread, the OMP_NUM_THREADS
rl-train was started with reaches every CPU training rank, and on a local Ray a rank
takes a worker Ray prestarted (no runtime_env of its own when it would change nothing)."""

import os
import threading
import time

import pytest

from rl_launcher.roles.train_group import cpu_threads_env, with_import_path, without_inherited
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


def test_only_variables_the_workers_would_not_inherit_stay_in_the_runtime_env():
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}}
    assert without_inherited(env, {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}) is None
    kept = without_inherited(env, {"OMP_NUM_THREADS": "1"})
    assert kept == {"env_vars": {"MKL_NUM_THREADS": "1"}}
    assert without_inherited(env, None) == env  # attached to a cluster: everything kept
    assert without_inherited({}, None) is None


def test_a_rank_on_a_local_ray_takes_a_prestarted_worker_with_the_started_with_threads(
    monkeypatch,
):
    """The env rl-train gives a CPU rank, on a Ray this process started: a worker that
    existed before the actor was asked for, with the OMP/MKL threads rl-train was started
    with; a value the workers did not inherit still reaches the rank. The Ray is begun as
    rl-train begins it, on a thread of its own while the driver starts (start_early), and
    taken over by connect; its processes outlive what the starting thread did. stop_local_ray
    then stops that Ray, its autoscaler monitor killed first."""
    import ray

    from rl_launcher.config.loader import load_config
    from rl_launcher.infra.ray_cluster import connect, start_early, starting_early, stop_local_ray

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, "1")
    start_early(load_config(["--cluster.cpus_per_bundle", "2"])[0])
    assert starting_early()
    assert connect(num_cpus=2) == "started"  # the Ray start_early began
    assert not starting_early() and ray.is_initialized()
    try:
        inherited = dict(os.environ)  # as start_trainer takes it
        monitor = ray._private.worker._global_node.all_processes["monitor"][0].process

        @ray.remote(num_cpus=1)
        class Rank:
            def environment(self):
                threads = (os.environ.get(n) for n in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"))
                return os.getpid(), *threads

        env = without_inherited(with_import_path(cpu_threads_env(1, "1")), inherited)
        assert env is None
        prestarted = prestarted_workers(ray._private.worker._global_node)
        pid, omp, mkl = ray.get(Rank.options(runtime_env=env).remote().environment.remote())
        assert (omp, mkl) == ("1", "1")
        assert pid in prestarted

        env = without_inherited(cpu_threads_env(1, "2"), inherited)  # not what they inherit
        pid, omp, mkl = ray.get(Rank.options(runtime_env=env).remote().environment.remote())
        assert (omp, mkl) == ("2", "2")
        assert pid not in prestarted  # a runtime_env: a worker started for it
    finally:
        stop_local_ray()
    assert not ray.is_initialized() and monitor.poll() is not None


def test_a_ray_begun_early_and_never_taken_is_left_to_an_exiting_process():
    """stop_early: nothing to do without an early Ray; without ``wait`` (rl-train exits
    right after) one still starting is let go at once."""
    from concurrent.futures import Future

    from rl_launcher.infra import ray_cluster

    ray_cluster.stop_early()
    ray_cluster._early = Future()  # still starting
    started = time.monotonic()
    ray_cluster.stop_early(wait=False)
    assert time.monotonic() - started < 1 and not ray_cluster.starting_early()


def prestarted_workers(node, timeout_s: float = 60.0) -> set[int]:
    """The pids of the idle workers the raylet started with the driver (waited for)."""
    import psutil

    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = {
            child.pid
            for child in raylet.children()
            if child.cmdline()[:1] == ["ray::IDLE"]  # a worker's title until it has a task
        }
        if workers:
            return workers
        time.sleep(0.1)
    raise AssertionError("the raylet prestarted no worker")
