"""``rollout.data_plane: workers`` builds the driver path's batches from references: the
same step through :class:`DataBuffer` (Samples) and :class:`RowsBuffer` (SampleRows whose
token data sits in Ray's object store) gives, rank by rank, identical TrainBatches, metrics
and minibatches; and the option refuses, before Ray, what it does not run."""

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rl_core.batch import PER_TOKEN_FIELDS
from rl_core.types import Sample, SampleStatus
from rl_launcher.config.loader import load_config
from rl_launcher.data.buffer import DataBuffer
from rl_launcher.loops.step import minibatches
from rl_launcher.loops.step_metrics import (
    fresh_only,
    fresh_seqs,
    log_prob_gap,
    mismatch,
    with_gap_seqs,
)
from rl_launcher.roles.rollout_workers import RowsBuffer, merged_metrics, stored
from rl_launcher.roles.worker_rows import HeldValues
from rl_launcher.roles.worker_rows import log_prob_gap as log_prob_gap_of_rank

GROUP_SIZE, NUM_GROUPS, NUM_RANKS = 4, 6, 3


def a_group(draw: int, rng: random.Random) -> list[Sample]:
    """A scored group of ragged samples: some with a tool-turn loss mask, some with an
    engine's all-ones mask (a list), one (in group 2) whose reward failed and was skipped."""
    prompt = [rng.randrange(50) for _ in range(rng.randint(1, 6))]
    group = []
    for i in range(GROUP_SIZE):
        length = rng.randint(1, 9)
        mask = {1: [rng.choice((0, 0, 1)) for _ in range(length)], 2: [1] * length}.get(i)
        sample = Sample(
            tokens=prompt + [rng.randrange(50) for _ in range(length)],
            response_length=length,
            loss_mask=mask,
            reward=float(rng.random() < 0.5) + 0.25 * i,
            status=SampleStatus.TRUNCATED if i == 3 else SampleStatus.COMPLETED,
            rollout_log_probs=[-rng.random() for _ in range(length)],
            weight_versions=["0"] if draw != 4 else ["-1", "0"],
            group_index=draw,
            index=draw * GROUP_SIZE + i,
            metadata={"draw": draw},
        )
        if draw == 2 and i == 0:
            sample.status, sample.metadata["reward_error"] = SampleStatus.ABORTED, "failed"
        group.append(sample)
    return group


def assert_same_batch(expected, got) -> None:
    assert torch.equal(expected.tokens, got.tokens)
    assert torch.equal(expected.cu_seqlens, got.cu_seqlens)
    for name in PER_TOKEN_FIELDS:
        want, have = getattr(expected, name), getattr(got, name)
        assert (want is None) == (have is None), name
        if want is not None:
            assert torch.equal(want, have), name
    assert (expected.global_num_tokens, expected.global_num_seqs) == (
        got.global_num_tokens,
        got.global_num_seqs,
    )


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus"])
def test_rows_give_the_driver_paths_batches(ray_cluster, estimator):
    rng = random.Random(0)
    groups = [a_group(draw, rng) for draw in range(NUM_GROUPS)]
    rows = [stored(group) for group in groups]  # put into the object store
    assert all(len(s.tokens) == 0 for g in rows for s in g)  # no token lists left
    masks = [(s.index % GROUP_SIZE, s.loss_mask) for g in rows for s in g]
    assert all(mask is None for i, mask in masks if i == 2)  # all ones: no list either
    assert any(mask is not None for i, mask in masks if i == 1)

    settings = {"group_size": GROUP_SIZE, "num_ranks": NUM_RANKS, "advantage_estimator": estimator}
    driver, workers = DataBuffer(**settings), RowsBuffer(**settings)
    driver.add_groups(groups)
    workers.add_groups(rows)
    expected, got = driver.pop_step(NUM_GROUPS), workers.pop_step(NUM_GROUPS)
    assert got.partitions == expected.partitions and got.group_sizes == expected.group_sizes
    assert got.metrics == expected.metrics
    for want, plan in zip(expected.rank_batches, got.rank_batches, strict=True):
        assert (plan.num_seqs, plan.num_tokens) == (want.num_seqs, want.num_tokens)
        assert torch.equal(plan.loss_mask, want.loss_mask)
        assert torch.equal(plan.rollout_log_probs, want.rollout_log_probs)
        assert_same_batch(want, plan.to_train_batch())

    # the old log-probs the trainer computes: handed back (driver) or held by the rank with
    # its gap's scalars (workers); then the loop's minibatches and the gap metric
    version = 0  # group 4's samples began on version -1: not fresh
    old = [torch.randn(b.num_tokens) for b in expected.rank_batches]
    want_batches = [
        replace(b, old_log_probs=o) for b, o in zip(expected.rank_batches, old, strict=True)
    ]
    marked = with_gap_seqs(got, trainer_version=version)
    assert [p.gap_seqs for p in marked] == fresh_seqs(expected, trainer_version=version)
    assert any(len(p.gap_seqs) < p.num_seqs for p in marked)  # a rank with a stale sequence
    plans = [
        replace(p, old_log_probs=p.hold(o.numpy(), rank_gap(p, o)))
        for p, o in zip(marked, old, strict=True)
    ]
    assert all(isinstance(p.old_log_probs, HeldValues) for p in plans)  # not on the driver
    for want_part, part in zip(minibatches(want_batches, 2), minibatches(plans, 2), strict=True):
        for want, plan in zip(want_part, part, strict=True):
            assert isinstance(plan.old_log_probs, HeldValues)
            assert_same_batch(want, plan.to_train_batch())
    want_gap = log_prob_gap(want_batches, expected, trainer_version=version)
    got_gap = log_prob_gap(plans, got, trainer_version=version)
    assert want_gap == mismatch(fresh_only(want_batches, expected, trainer_version=version))
    assert (
        got_gap.keys()
        == want_gap.keys()
        == {
            "mismatch/logprob_abs_diff_mean",
            "mismatch/logprob_abs_diff_max",
        }
    )
    assert got_gap["mismatch/logprob_abs_diff_max"] == want_gap["mismatch/logprob_abs_diff_max"]
    mean = "mismatch/logprob_abs_diff_mean"  # float32 sums in another order: last bits
    assert got_gap[mean] == pytest.approx(want_gap[mean], rel=1e-6)
    one = log_prob_gap(plans[:1], got, trainer_version=version)  # one rank: the same number
    assert one == mismatch([want_batches[0].select(marked[0].gap_seqs)])


def rank_gap(plan, old):
    """What a rank's log-prob pass measures (TrainWorker.log_probs)."""
    return log_prob_gap_of_rank(plan.to_train_batch(), old, plan.gap_seqs)


def test_workers_metrics_merge_as_one_rollout():
    def row(length, status=SampleStatus.COMPLETED):
        return Sample(response_length=length, status=status)

    class Out:
        def __init__(self, kept, metrics, counts):
            self.kept, self.left, self.metrics, self.reward_counts = kept, [], metrics, counts

    counted = {"rollout/groups_launched": 2.0, "rollout/reward_errors": 1.0}
    means = {"rollout/truncated_frac": 0.5, "rollout/response_length_mean": 9.0}
    first = Out([[row(2), row(4, SampleStatus.TRUNCATED)]], counted | means, {"reward_errors": 2})
    second = Out([[row(6)]], counted | means, {"reward_errors": 0})
    merged = merged_metrics([first, second])
    assert merged["rollout/groups_launched"] == 4.0
    assert merged["rollout/reward_errors"] == 1.0 + 1.0 + 2  # rl-sglang's and the reward's
    assert merged["rollout/response_length_mean"] == 4.0  # (2 + 4 + 6) / 3
    assert merged["rollout/truncated_frac"] == 1 / 3


QUICKSTART = "examples/quickstart/config.yaml"


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--logging.dump_train_batch", "true"], "logging.dump_train_batch"),
        (["--rollout.dump_dir", "/tmp/d"], "rollout.dump_dir"),
        (["--algorithm.old_log_probs", "rollout"], "algorithm.old_log_probs=rollout"),
        (["--algorithm.advantage_estimator", "gae"], "algorithm.advantage_estimator=gae"),
    ],
)
def test_workers_refuse_what_reads_tokens_on_the_driver(extra, named):
    root = Path(__file__).resolve().parents[3]
    argv = ["--config", str(root / QUICKSTART), "--rollout.data_plane", "workers", *extra]
    with pytest.raises(ValueError, match=f"rollout.data_plane=workers .*{named}"):
        load_config(argv)
