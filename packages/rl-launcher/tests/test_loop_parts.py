"""The loops' parts that need no processes: the asynchronous producer's queue, staleness
and the on-policy subset of a step, partial-rollout restarts, the data-order log."""

import asyncio
from pathlib import Path

import pytest
import torch

from rl_core.types import Sample, SampleStatus
from rl_launcher.config.checks import check_loop
from rl_launcher.config.loader import load_config
from rl_launcher.data.buffer import DataBuffer
from rl_launcher.infra import data_order
from rl_launcher.loops.step_metrics import fresh_only, mismatch, staleness
from rl_launcher.roles.async_rollout import ContinuousRollout, group_version, restart
from rl_launcher.roles.default_rollout import relabel
from rl_sglang.rollout.default import RolloutResult

ROOT = Path(__file__).resolve().parents[3]


def group(draw: int, version: str | list[str], *, size: int = 2, status="completed") -> list:
    versions = [version] if isinstance(version, str) else version
    return [
        Sample(
            tokens=[1, 2, 3],
            response_length=1,
            reward=float(i),
            status=status,
            weight_versions=list(versions),
            group_index=draw,
            index=draw * size + i,
            rollout_log_probs=[-0.5],
            metadata={"draw": draw, "dataset": "d", "row": 10 + draw},
        )
        for i in range(size)
    ]


class ScriptedManager:
    """Stands in for the rollout manager: each generate() call returns the next prepared
    result (then waits forever), and records what it was asked."""

    def __init__(self, results):
        self.results, self.calls, self.consumed_draws = list(results), [], []

    async def generate(self, num_groups, num_prompts, resume=()):
        self.calls.append((num_groups, num_prompts, [[s.tokens for s in g] for g in resume]))
        if not self.results:
            await asyncio.Event().wait()
        return self.results.pop(0)

    def consumed(self, groups):
        self.consumed_draws += [g[0].group_index for g in groups]


def aborted_group(draw: int) -> list:
    cut = group(draw, "0", status="aborted")
    for sample in cut:
        sample.tokens, sample.response_length = [1, 2, 3, 9, 8], 2  # a partial response
        sample.rollout_log_probs = [-0.1, -0.2]
    return cut


async def produce_and_take(partial: bool, policy: str):
    chunks = [
        RolloutResult([group(0, "0"), group(1, "1")], [aborted_group(2)], {}),
        RolloutResult([group(2, ["0", "2"]), group(3, "2")], [], {}),
    ]
    manager = ScriptedManager(chunks)
    producer = ContinuousRollout(
        manager, batch_size=2, max_staleness=1, partial=partial, stale_policy=policy
    )
    await producer.start()
    for _ in range(5):
        await asyncio.sleep(0)
    calls_while_full = len(manager.calls)  # 2 groups queued = batch_size * max_staleness
    taken, metrics = await producer.take(2, min_version=1)
    for _ in range(5):  # room again: the producer asks for its next chunk
        await asyncio.sleep(0)
    await producer.stop()
    return manager, calls_while_full, taken, metrics


def test_async_producer_waits_while_the_queue_is_full_and_drops_stale_groups():
    manager, calls_while_full, taken, metrics = asyncio.run(produce_and_take(True, "drop"))
    assert calls_while_full == 1
    # group 0 (version 0 < 1) dropped; group 2 resumed across versions 0 and 2 -> oldest 0
    assert [g[0].group_index for g in taken] == [1, 3]
    assert manager.consumed_draws == [0, 2]
    assert metrics["async/stale_groups_dropped"] == 2 and metrics["async/stale_groups_kept"] == 0
    assert metrics["async/groups_aborted"] == 1
    # the second chunk resumed the aborted group with its partial response, one new prompt
    assert manager.calls[1][:2] == (2, 1) and manager.calls[1][2] == [[[1, 2, 3, 9, 8]] * 2]


def test_async_producer_keeps_stale_groups_for_importance_and_restarts_without_partial():
    manager, _, taken, metrics = asyncio.run(produce_and_take(False, "importance"))
    assert [g[0].group_index for g in taken] == [0, 1]
    assert metrics["async/stale_groups_kept"] == 1 and metrics["async/stale_groups_dropped"] == 0
    assert manager.calls[1][2] == [[[1, 2, 3]] * 2]  # the aborted response started over


def test_restart_resets_only_aborted_samples_and_group_version_is_the_oldest():
    mixed = group(4, "3") + aborted_group(4)[:1]
    restart(mixed)
    assert [s.status for s in mixed] == [SampleStatus.COMPLETED] * 2 + [SampleStatus.PENDING]
    assert mixed[2].tokens == [1, 2, 3] and mixed[2].response_length == 0
    assert mixed[2].rollout_log_probs is None and mixed[2].weight_versions == []
    assert group_version(group(0, ["5", "3"]), default=9) == 3
    assert group_version([Sample(tokens=[1])], default=9) == 9


def test_relabel_numbers_groups_by_draw():
    cut = group(0, "0")
    for sample in cut:
        sample.metadata["draw"] = 7
    relabel(cut)
    assert [(s.group_index, s.index) for s in cut] == [(7, 14), (7, 15)]


def test_staleness_and_the_fresh_subset_of_a_step():
    buffer = DataBuffer(group_size=2, num_ranks=2)
    samples = [s for g in (group(0, "4"), group(1, "3"), group(2, ["3", "4"])) for s in g]
    buffer.add(samples)
    batch = buffer.pop_step(3)
    stats = staleness(batch, trainer_version=4)
    assert stats["rollout/staleness_max"] == 1 and stats["rollout/weight_version_min"] == 3
    assert stats["rollout/staleness_mean"] == pytest.approx(4 / 6)
    for b in batch.rank_batches:  # trainer log-probs: -0.5 + 0.25 on every position
        b.old_log_probs = torch.full_like(b.loss_mask, -0.25, dtype=torch.float32)
        b.rollout_log_probs = torch.full_like(b.loss_mask, -0.5, dtype=torch.float32)
    fresh = fresh_only(batch.rank_batches, batch, trainer_version=4)
    assert sum(b.num_seqs for b in fresh) == 2  # only group 0 is entirely version 4
    assert mismatch(fresh)["mismatch/logprob_abs_diff_max"] == 0.25
    assert fresh_only(batch.rank_batches, batch, trainer_version=7) == []
    everyone = DataBuffer(group_size=2, num_ranks=2)
    everyone.add([s for g in (group(0, "4"), group(1, "4")) for s in g])
    whole = everyone.pop_step(2)
    fresh = fresh_only(whole.rank_batches, whole, trainer_version=4)
    assert all(f is b for f, b in zip(fresh, whole.rank_batches, strict=True))  # no copy


def test_data_order_log_survives_a_torn_line_and_truncates(tmp_path):
    data_order.append(tmp_path, 1, [group(0, "0"), group(1, "0")])
    data_order.append(tmp_path, 2, [group(2, "1")])
    with open(tmp_path / data_order.DATA_ORDER_FILE, "a") as file:
        file.write('{"step": 3, "pro')  # killed mid-write
    assert [r["prompts"] for r in data_order.read(tmp_path)] == [["d:10", "d:11"], ["d:12"]]
    data_order.truncate(tmp_path, 1)
    assert data_order.read(tmp_path) == [{"step": 1, "prompts": ["d:10", "d:11"], "draws": [0, 1]}]


def test_loop_settings_that_cannot_work_together_are_refused():
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        load_config(["--rollout.loop", "async", "--rollout.max_staleness", "0"])
    config, _ = load_config(
        ["--rollout.loop", "one_step_async", "--rollout.stale_policy", "importance"]
    )
    with pytest.raises(ValueError, match=r"set algorithm\.rollout_is_level=token"):
        check_loop(config)
    config.algorithm.rollout_is_level = "token"
    check_loop(config)


def test_overlapping_loops_on_cpu_split_the_cores_between_trainer_and_engines(monkeypatch):
    from rl_launcher.infra.colocation import engine_threads_env, engines_beside_training

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    config, _ = load_config(["--engine.num_engines", "2", "--cluster.devices_per_node", "2"])
    assert engines_beside_training(config) == 0 and engine_threads_env(config, 2) == {}
    config.rollout.loop = "async"  # 2 ranks + 2 engines generating beside them: 2 cores each
    assert engines_beside_training(config) == 2
    assert engine_threads_env(config, 2) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    config.cluster.device = "cuda"
    assert engines_beside_training(config) == 0


def test_old_log_probs_from_the_train_step_only_for_one_update_without_reward_kl():
    config, _ = load_config(["--algorithm.old_log_probs", "train_step"])
    check_loop(config)  # one minibatch, no KL-shaped reward: the train step gives them
    for extra in (
        ["--algorithm.num_minibatches", "2"],
        [
            "--algorithm.reward_kl_coef",
            "0.1",
            "--algorithm.advantage_estimator",
            "reinforce_plus_plus",
        ],
    ):
        config, _ = load_config(["--algorithm.old_log_probs", "train_step", *extra])
        with pytest.raises(ValueError, match=r"old_log_probs=train_step .* use recompute"):
            check_loop(config)
