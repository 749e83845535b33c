"""``rollout.data_plane: workers`` against the default, on real runs: the quickstart shrunk
to 2 steps of 16 samples (Ray, an embedded engine behind the router, an rl-fsdp rank), with
a reward that fails on some responses under ``rollout.on_reward_error=skip``, in the
one-step off-policy loop (step 2's rollout runs while step 1 trains; the synchronous loop
runs the same rollout function, and ``test_scale_sim`` runs it on both planes). The worker
path (a rollout worker generating and scoring, token data in the object store, the rank
assembling its batch from references) records the same metrics, step for step: samples,
rewards, skipped rewards, staleness, advantages, losses, gradient norms, the KL to the
reference and the trainer/engine log-prob gap (the worker path keeps the old and reference
log-probs on the rank and reduces the gap from the rank's scalars; step 2's samples are a
version old, so only step 1 has a gap)."""

import os
from pathlib import Path

import pytest
from test_same_seed import TIMES
from test_train_loop import shrunk

from rl_launcher.cli import main
from rl_launcher.infra.run_log import read_metrics

pytestmark = pytest.mark.integration
NUM_STEPS = 2


def records(root, plane: str) -> list[dict]:
    args = shrunk(
        root / plane,
        "--num_steps",
        str(NUM_STEPS),
        "--checkpoint.interval",
        "0",
        "--checkpoint.dir",
        str(root / f"{plane}_ckpt"),
        "--rollout.reward",
        "failing_rewards:fails_on_low_digits",
        "--rollout.on_reward_error",
        "skip",
        "--rollout.data_plane",
        plane,
        "--algorithm.kl_coef",
        "0.05",  # reference log-probs: held by the rank on the worker path
        "--rollout.loop",
        "one_step_async",  # step 2's rollout runs on the workers while step 1 trains
    )
    assert main(args) == 0
    return [
        {k: v for k, v in r.items() if k != "time" and not k.startswith(TIMES)}
        for r in read_metrics(root / plane)
    ]


def test_workers_record_the_driver_paths_steps(ray_cluster, tmp_path, monkeypatch):
    # the rollout worker (a Ray actor) imports the test's reward by its dotted path
    path = [str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    driver, workers = records(tmp_path, "driver"), records(tmp_path, "workers")
    assert [r["step"] for r in workers] == list(range(1, NUM_STEPS + 1))
    for expected, got in zip(driver, workers, strict=True):
        assert got == expected
    assert "loss/pg" in driver[-1] and driver[-1]["loss/kl"] != 0
    assert driver[-1]["rollout/staleness_max"] == 1  # generated while step 1 trained
    # the engine/trainer gap, over step 1's samples only (step 2's are a step old); on the
    # CPU in float32 both sides may compute it bit for bit (0.0), so only its presence and
    # its equality on both paths (above) are checked
    gap = driver[0]
    assert 0.0 <= gap["mismatch/logprob_abs_diff_mean"] <= gap["mismatch/logprob_abs_diff_max"]
    assert "mismatch/logprob_abs_diff_max" not in driver[-1]
    assert sum(r["rollout/reward_errors"] for r in driver) > 0  # skipped rewards were merged
