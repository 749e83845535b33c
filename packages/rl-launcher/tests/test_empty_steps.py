"""Steps that train nothing, without processes: the cause a step records (from its samples),
the progress line, and when the run stops (rl_launcher.infra.faults.check_trained). A real
rl-train whose reward fails on every sample is in test_stop_signals.py. In the fully
asynchronous loop, failed groups reach the step (rather than being retried for ever)."""

import asyncio
from types import SimpleNamespace

import pytest
from test_loop_parts import ScriptedManager, aborted_group, group

from rl_core.types import Sample, SampleStatus
from rl_launcher.config import TrainConfig
from rl_launcher.data.buffer import DataBuffer
from rl_launcher.infra import faults
from rl_launcher.infra.run_log import format_progress
from rl_launcher.loops.rl import run_step
from rl_launcher.roles.async_rollout import ContinuousRollout
from rl_sglang.rollout.default import RolloutResult

REFUSAL = "EngineError: http://127.0.0.1:30000 -> HTTP 400: top_k must be -1 (off) or >= 1, got 0"
REWARD = "reward 'my:score' failed on sample 4 (response '7', label '7'): KeyError: 'answer'"


def samples(draw: int, size: int = 4, *, status="completed", reward=1.0, **metadata) -> list:
    return [
        Sample(
            tokens=[1, 2, 3],
            response_length=1,
            reward=reward + i,
            status=status,
            group_index=draw,
            index=draw * size + i,
            metadata=dict(metadata),
        )
        for i in range(size)
    ]


def test_cause_quotes_the_engine_refusal_and_counts_every_kind():
    config = TrainConfig()
    refused = [
        samples(0, status="aborted", error=REFUSAL),
        samples(1, status="aborted", error=REFUSAL),
    ]
    assert faults.empty_cause(refused, config) == (
        f"of 8 samples, 8 refused or failed by the engine (first: {REFUSAL})"
    )
    failed = samples(2)
    failed[1].status, failed[1].metadata["reward_error"] = SampleStatus.ABORTED, REWARD
    config.algorithm.group_filter = "nonzero_std"
    cause = faults.empty_cause(
        [failed, samples(3, reward=0.0), samples(4, status="aborted")], config
    )
    assert cause == (  # group 2 lost one sample to its reward, its other 3 were filtered
        "of 12 samples, 1 whose reward failed, skipped under rollout.on_reward_error=skip "
        f"(first: {REWARD}); 4 aborted; 2 group(s) dropped by algorithm.group_filter=nonzero_std"
    )
    assert faults.empty_cause([], config) == "the rollout returned no samples"
    long = samples(5, status="aborted", error="x" * 1000)
    assert len(faults.empty_cause([long], config)) < 400


def a_run(*, limit: int, num_steps: int = 10, progress: bool = True):
    config = TrainConfig()
    config.algorithm.max_empty_steps, config.num_steps = limit, num_steps
    config.logging.progress = progress
    return SimpleNamespace(config=config, extras={})


def step(trained: int, cause: str = "of 16 samples, 16 refused") -> dict:
    metrics = {faults.TRAINED_KEY: float(trained), faults.BATCH_KEY: 16.0}
    return metrics if trained else metrics | {faults.EMPTY_CAUSE_KEY: cause}


def test_the_run_stops_after_max_empty_steps_in_a_row_naming_the_cause():
    run = a_run(limit=3)
    for number, trained in enumerate([0, 0, 16, 0, 0], start=1):
        faults.check_trained(run, number, step(trained))  # 2 in a row, reset, 2 in a row
    with pytest.raises(faults.RunStopped) as stopped:
        faults.check_trained(run, 6, step(0, "of 16 samples, 16 whose reward failed"))
    assert str(stopped.value) == (
        "3 steps in a row up to step 6 trained no sample (algorithm.max_empty_steps=3); "
        "step 6: of 16 samples, 16 whose reward failed"
    )


def test_zero_never_stops_in_a_row_but_a_run_that_trained_nothing_fails_at_its_end(capsys):
    run = a_run(limit=0, num_steps=5, progress=False)
    for number in range(1, 5):
        faults.check_trained(run, number, step(0))
    assert run.extras["empty_in_a_row"] == 4
    assert (
        "rl-train: step 4 trained no sample: of 16 samples, 16 refused" in capsys.readouterr().err
    )
    with pytest.raises(faults.RunStopped, match=r"^the run trained no sample in its 5 step\(s\); "):
        faults.check_trained(run, 5, step(0))
    learnt = a_run(limit=0, num_steps=3)
    for number, trained in enumerate([12, 0, 0], start=1):
        faults.check_trained(learnt, number, step(trained))  # something was learnt: no stop


def test_the_end_of_run_rule_counts_only_this_process_steps():
    resumed = a_run(limit=5, num_steps=4)  # a --resume from step 2: steps 3 and 4 run here
    faults.check_trained(resumed, 3, step(0))
    with pytest.raises(faults.RunStopped, match=r"in its 2 step\(s\)"):
        faults.check_trained(resumed, 4, step(0))
    faults.check_trained(a_run(limit=1), 1, {"loss/sft": 0.3})  # SFT steps are not counted


def test_progress_line_shows_samples_trained_and_the_cause_of_nothing():
    line = format_progress(
        3,
        20,
        {
            faults.TRAINED_KEY: 48.0,
            faults.BATCH_KEY: 64.0,
            "rollout/reward/mean": 0.5,
            "time/step": 1.0,
        },
    )
    assert line == "step 3/20 | reward 0.500 | trained 48/64 | 1.00s"
    empty = step(0, f"of 16 samples, 16 refused or failed by the engine (first: {REFUSAL})")
    assert format_progress(1, 2, empty | {"time/step": 0.03, "time/rollout": 0.03}) == (
        "step 1/2 | trained 0/16 (nothing learnt: of 16 samples, 16 refused or failed by the "
        f"engine (first: {REFUSAL})) | 0.03s (rollout 0.03)"
    )


class Feed:
    def __init__(self, groups):
        self.groups_of_step = groups

    def groups(self, step):
        return self.groups_of_step, {}


def test_a_step_whose_samples_all_failed_records_zero_trained_and_why(tmp_path):
    config = TrainConfig()
    config.logging.run_dir = str(tmp_path)
    rollout = SimpleNamespace(consumed=lambda groups: None)  # draws nothing, never trains
    run = SimpleNamespace(config=config, rollout=rollout, trainer=None, extras={})
    buffer = DataBuffer(group_size=4, num_ranks=1)
    failed = [samples(d, status="aborted", reward_error=REWARD) for d in range(3)]
    metrics = run_step(run, buffer, 1, Feed(failed))
    assert metrics[faults.TRAINED_KEY] == 0.0 and metrics[faults.BATCH_KEY] == 12.0
    assert metrics["buffer/empty_step"] == 1.0
    assert metrics[faults.EMPTY_CAUSE_KEY].startswith("of 12 samples, 12 whose reward failed")


async def produce_failed_and_paused():
    failed_group = aborted_group(1)
    for sample in failed_group:
        sample.metadata["reward_error"] = REWARD
    chunks = [RolloutResult([group(0, "0")], [failed_group, aborted_group(2)], {})]
    manager = ScriptedManager(chunks)
    producer = ContinuousRollout(manager, batch_size=2, max_staleness=2, partial=True)
    await producer.start()
    taken, _ = await asyncio.wait_for(producer.take(2, min_version=0), timeout=10)
    for _ in range(5):
        await asyncio.sleep(0)
    await producer.stop()
    return manager, taken


def test_async_loop_hands_failed_groups_to_the_step_and_resumes_only_paused_ones():
    manager, taken = asyncio.run(produce_failed_and_paused())
    assert [g[0].group_index for g in taken] == [0, 1]  # group 1 failed: the step drops it
    assert all(s.metadata["reward_error"] == REWARD for s in taken[1])
    assert [len(resumed) for _, _, resumed in manager.calls] == [0, 1]  # only group 2 again


def test_steps_whose_groups_were_only_filtered_neither_count_nor_break_the_streak():
    """A weak model on a hard task often scores whole groups alike (all 0): those steps are
    reported, but do not stop a run; failures around them still add up."""
    run = a_run(limit=2, num_steps=50)
    filtered = step(0, "of 16 samples, 4 group(s) dropped by algorithm.group_filter=nonzero_std")
    filtered[faults.EMPTY_FAILED_KEY] = 0.0
    failed = step(0) | {faults.EMPTY_FAILED_KEY: 16.0}
    for number in range(1, 11):
        faults.check_trained(run, number, filtered)
    assert run.extras["empty_in_a_row"] == 0
    faults.check_trained(run, 11, failed)
    faults.check_trained(run, 12, filtered)
    with pytest.raises(faults.RunStopped, match="2 steps in a row up to step 13"):
        faults.check_trained(run, 13, failed)
    only_filtered = a_run(limit=2, num_steps=3)  # nothing trained at all still fails at the end
    faults.check_trained(only_filtered, 1, filtered)
    faults.check_trained(only_filtered, 2, filtered)
    with pytest.raises(faults.RunStopped, match="the run trained no sample"):
        faults.check_trained(only_filtered, 3, filtered)
