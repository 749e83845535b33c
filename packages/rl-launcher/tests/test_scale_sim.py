"""bench/scale_sim.py at its smallest size: 8 simulated GPUs on one simulated node,
colocated, 2 steps, through the launcher's real start-up, router, loop, weight-sync
orchestration and checkpoints with stand-in engines and ranks (:mod:`rl_launcher.simulated`),
with each ``rollout.data_plane`` in the synchronous and the fully asynchronous loop, on one
cluster. Checks the output's shape, that every timing is positive, that each step was
measured once, that the synchronous runs took colocated turns (engines released and
resumed, ranks offloaded and onloaded), and that with ``workers`` the ranks fetched the
token data the driver no longer hands to Ray."""

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
BENCH = Path(__file__).resolve().parents[3] / "bench" / "scale_sim.py"
NUM_STEPS = 2
PLANES = ("driver", "workers")


def load_bench():
    spec = importlib.util.spec_from_file_location("scale_sim", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_eight_simulated_gpus_two_steps(tmp_path):
    bench = load_bench()
    argv = ["--gpus", "8", "--layouts", "colocated", "--loops", "sync,async"]
    argv += ["--steps", str(NUM_STEPS), "--max-response-tokens", "32", "--train-s", "0.05"]
    argv += ["--data-planes", "driver,workers"]
    results = bench.main([*argv, "--work-dir", str(tmp_path), "--out", str(tmp_path / "r.json")])
    runs = [(r.get("loop"), r.get("data_plane")) for r in results]
    assert runs == [(loop, plane) for loop in ("sync", "async") for plane in PLANES], results
    for result in results:
        check_run(bench, result)
    for sync_run in results[:2]:  # colocated turns around every log-prob pass and sync
        for step in sync_run["steps"]:
            for turn in ("engine_release", "engine_resume", "trainer_offload", "trainer_onload"):
                assert step[f"time/turns/{turn}"] > 0, (sync_run["data_plane"], turn)
    driver, workers = (r["steps"][-1] for r in results[:2])
    assert workers["rows/fetched_bytes"] > 0 and driver["rows/fetched_bytes"] == 0
    assert workers["ray/batch_bytes"] < driver["ray/batch_bytes"]  # references, not tokens
    assert "time/turns" not in results[2]["steps"][-1]  # the overlapping loop takes no turns


def check_run(bench, result: dict) -> None:
    assert "error" not in result, result
    assert (result["gpus"], result["num_engines"], result["num_train_ranks"]) == (8, 8, 8)
    assert result["samples_per_step"] == 8 * 8  # one prompt per GPU, groups of 8
    startup = result["startup"]
    for key in ("time/start_run", "time/placement", "time/engines_and_router"):
        assert startup[key] > 0, key
    assert [s["step"] for s in result["steps"]] == list(range(1, NUM_STEPS + 1))
    for step in result["steps"]:
        for key in (
            "time/rollout",
            "time/train",
            "time/sync",
            "time/checkpoint",
            "time/train_dispatch",
            "driver_cpu/step",
            "buffer/pop_step",
            "ray/batch_bytes",
            "driver/rss_bytes",
        ):
            assert step[key] > 0, (step["step"], key)
        assert step["sync/weight_version"] == step["step"]
    summary = bench.summary(result)
    assert summary["median"]["time/step"] > 0
