"""Batch scoring: input order, counted errors and timeouts, hung rewards cut off in processes."""

import time

import pytest

from rl_rewards.batch import ScoreResult, call_reward, score_batch

pytestmark = pytest.mark.integration


def test_inline_scores_in_order_and_counts_errors():
    report = score_batch("reward_helpers:boom", ["x", "boom", "y"], [None] * 3)
    assert report.scores == [0.5, 0.0, 0.5]
    assert report.results[1] == ScoreResult(0.0, "error", "RuntimeError: reward exploded")
    assert (report.num_errors, report.num_timeouts) == (1, 0)


def test_inline_timeout_uses_an_alarm():
    report = score_batch("reward_helpers:sleepy", ["5", "0"], [None, None], timeout_s=0.3)
    assert [r.status for r in report.results] == ["timeout", "ok"]


def test_non_numeric_scores_are_errors():
    report = score_batch("reward_helpers:not_a_number", ["nan", "str"], [None, None])
    assert [r.status for r in report.results] == ["error", "error"]
    assert "not a finite number" in report.results[0].reason


def test_hung_rewards_in_workers_time_out_without_stalling_the_batch():
    responses = ["hang", "ok", "ok", "hang", "ok", "ok", "ok", "ok"]
    start = time.monotonic()
    seen = []
    report = score_batch(
        "reward_helpers:hang",
        responses,
        [None] * len(responses),
        workers=2,
        timeout_s=1.0,
        on_result=lambda i, r: seen.append(i),
    )
    assert [r.status for r in report.results] == [
        "timeout" if r == "hang" else "ok" for r in responses
    ]
    assert report.scores == [0.0 if r == "hang" else 1.0 for r in responses]
    assert report.num_timeouts == 2 and sorted(seen) == list(range(len(responses)))
    assert time.monotonic() - start < 30


def test_pathological_sympy_input_is_cut_off_by_the_per_sample_timeout():
    # A big symbolic power: expanding it would take far longer than the timeout.
    hard = "\\boxed{(x+y+z+1)^{300}}"
    report = score_batch(
        "math", [hard, "\\boxed{2}"], ["(1+x+y+z)^{300} + 1", "2"], workers=1, timeout_s=2.0
    )
    assert report.results[1] == ScoreResult(1.0)
    assert report.results[0].status in ("timeout", "ok")
    assert report.results[0].score == 0.0


def test_workers_agree_with_inline_scoring():
    responses = [f"\\boxed{{{i}/2}}" for i in range(40)]
    labels = [str(i * 0.5) for i in range(40)]
    labels[3] = "7"
    inline = score_batch("math", responses, labels, workers=0)
    pooled = score_batch("math", responses, labels, workers=2)
    assert pooled.scores == inline.scores and sum(inline.scores) == 39


def test_bad_configuration_raises_value_error():
    with pytest.raises(ValueError, match="valid names"):
        score_batch("nope", ["a"], ["b"], workers=2)
    with pytest.raises(ValueError, match="one label each"):
        score_batch("math", ["a", "b"], ["c"])
    with pytest.raises(ValueError, match="timeout_s"):
        score_batch("math", ["a"], ["b"], timeout_s=0)


def test_call_reward_records_exception_type():
    def fails(response, label):
        raise KeyError("k")

    assert call_reward(fails, "", None).reason == "KeyError: 'k'"


def test_a_worker_that_dies_costs_only_its_sample():
    responses = ["ok", "die", "ok", "ok", "die", "ok"]
    report = score_batch("reward_helpers:die", responses, [None] * 6, workers=2, timeout_s=5.0)
    assert report.scores == [0.0 if r == "die" else 1.0 for r in responses]
    assert report.num_errors == 2 and "exit code 3" in report.results[1].reason


def test_a_hang_after_fast_samples_blames_the_right_sample():
    # Many quick samples precede each hang inside one chunk: results not yet sent when the
    # worker is killed must be rescored, not recorded as timeouts.
    responses = (["ok"] * 30 + ["hang"]) * 2 + ["ok"] * 10
    report = score_batch(
        "reward_helpers:hang", responses, [None] * len(responses), workers=1, timeout_s=1.0
    )
    assert [r.status for r in report.results] == [
        "timeout" if r == "hang" else "ok" for r in responses
    ]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("on_failure", ["zero", "drop"])
def test_raising_hanging_and_nan_rewards_are_scored_as_configured(workers, on_failure):
    """Each failure kind is counted, scored 0 or dropped, and the batch goes on."""
    failed = 0.0 if on_failure == "zero" else None
    for bad in ["boom", "nan", "inf", "hang" if workers else "sleep"]:
        responses = ["ok", bad, "ok", "ok"]
        report = score_batch(
            "reward_helpers:faulty",
            responses,
            [None] * 4,
            workers=workers,
            timeout_s=2.0 if workers else 0.5,
            on_failure=on_failure,
        )
        assert report.scores == [1.0, failed, 1.0, 1.0], bad
        assert report.results[1].status == ("timeout" if bad in ("hang", "sleep") else "error")
        assert report.num_errors + report.num_timeouts == 1
        assert report.num_dropped == (on_failure == "drop")
        assert report.kept == ([0, 2, 3] if on_failure == "drop" else [0, 1, 2, 3])


def test_unknown_on_failure_is_a_value_error():
    with pytest.raises(ValueError, match="on_failure"):
        score_batch("math", ["a"], ["b"], on_failure="ignore")
