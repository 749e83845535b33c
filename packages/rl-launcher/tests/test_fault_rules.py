"""The rules of rl_launcher.infra.faults that need no processes: counting non-finite steps
over minibatches and in a row, when the run stops, and what the message names."""

import math
from types import SimpleNamespace

import pytest

from rl_launcher.config import TrainConfig
from rl_launcher.infra import checkpoints, faults
from rl_launcher.infra.run_log import MetricsLog

GOOD = {"loss/total": 0.5, "train/grad_norm": 1.0, faults.NONFINITE_KEY: 0.0}
BAD = {"loss/total": math.nan, "train/grad_norm": math.inf, faults.NONFINITE_KEY: 1.0}


def a_run(tmp_path, *, limit: int, complete_steps=(), partial_steps=()):
    config = TrainConfig()
    config.algorithm.max_nonfinite_steps, config.algorithm.num_minibatches = limit, 2
    config.logging.run_dir = str(tmp_path / "run")
    root = checkpoints.checkpoint_dir(config)
    for step in (*complete_steps, *partial_steps):
        checkpoints.step_path(root, step).mkdir(parents=True)
        if step in complete_steps:
            checkpoints.write_state(checkpoints.step_path(root, step), {"step": step})
    return SimpleNamespace(config=config, extras={})


def test_minibatch_merge_counts_skips_and_keeps_the_bad_values():
    merged = faults.merge_minibatch_metrics({}, BAD)
    merged = faults.merge_minibatch_metrics(merged, GOOD)
    assert merged[faults.NONFINITE_KEY] == 1.0 and merged["loss/total"] == 0.5
    assert math.isnan(merged["train/nonfinite_loss"])
    assert merged["train/nonfinite_grad_norm"] == math.inf
    twice = faults.merge_minibatch_metrics(merged, BAD)
    assert twice[faults.NONFINITE_KEY] == 2.0
    assert faults.merge_minibatch_metrics({"x": 1.0}, {"x": 2.0}) == {"x": 2.0}


def test_run_stops_at_the_limit_of_nonfinite_steps_in_a_row(tmp_path, capsys):
    run = a_run(tmp_path, limit=2, complete_steps=(2, 3), partial_steps=(4,))
    merged = faults.merge_minibatch_metrics(GOOD, BAD)
    for step, metrics in enumerate([merged, GOOD, merged], start=1):
        faults.check_step(run, step, metrics)  # 1 in a row, reset, 1 in a row
    warning = "step 3: 1 of 2 minibatch updates skipped for a non-finite loss (nan) or "
    assert warning + "gradient norm (inf); 1 such step(s) in a row" in capsys.readouterr().err
    with pytest.raises(faults.RunStopped, match="2 non-finite steps in a row up to step 4"):
        faults.check_step(run, 4, merged)
    try:
        faults.check_step(run, 5, merged)
    except faults.RunStopped as error:
        message = faults.stop_message(run.config, error)
    step3 = checkpoints.step_path(checkpoints.checkpoint_dir(run.config), 3)
    assert message.endswith(f"last complete checkpoint: {step3} (step 3); continue with --resume")


def test_limit_zero_never_stops(tmp_path):
    run = a_run(tmp_path, limit=0)
    for step in range(1, 20):
        faults.check_step(run, step, BAD)
    assert run.extras["nonfinite_in_a_row"] == 19


def test_dead_actor_message_names_rank_last_step_and_checkpoint(tmp_path):
    run = a_run(tmp_path, limit=3)
    log = MetricsLog(run.config.logging.run_dir)
    for step in (1, 2):
        log.append(step, GOOD)
    died = faults.TrainActorDied(1, "train_steps", RuntimeError("The actor died unexpectedly."))
    assert faults.stop_message(run.config, died) == (
        "training rank 1 (its Ray actor) died during train_steps: The actor died unexpectedly. "
        "(after step 2 was recorded); no complete checkpoint yet (--resume would start again "
        "at step 1)"
    )
