"""Data buffer: grouping, filtering, advantages and per-rank batches, with hand values."""

import math

import pytest
import torch

from rl_core.types import Sample, SampleStatus
from rl_launcher.data.buffer import DataBuffer

A = 0.5 / (math.sqrt(0.5) + 1e-6)  # GRPO advantage of a {1, 0} pair: 0.5 / (unbiased std + eps)


def sample(group, index, tokens, response_length, reward, status="completed"):
    return Sample(
        tokens=tokens,
        response_length=response_length,
        reward=reward,
        group_index=group,
        index=index,
        status=SampleStatus(status),
    )


def grpo_samples():
    return [
        sample(2, 1, [5, 6], 1, 1.0),
        sample(0, 0, [1, 2, 3, 4, 5], 2, 1.0),
        sample(1, 0, [7, 8, 9, 9, 9], 3, 1.0),
        sample(1, 1, [7, 8, 9], 1, 1.0),  # completes group 1: all rewards equal, filtered
        sample(0, 1, [1, 2, 3, 6], 1, 0.0),
        sample(2, 0, [5, 6, 7, 8, 9, 10], 5, 0.0),
    ]


def test_grpo_step_with_filter_and_two_ranks():
    buffer = DataBuffer(
        group_size=2, num_ranks=2, advantage_estimator="grpo", group_filter="nonzero_std"
    )
    buffer.add(grpo_samples())
    assert buffer.num_ready_groups == 2
    step = buffer.pop_step(2)
    assert [(s.group_index, s.index) for s in step.samples] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    # token counts 5, 4, 6, 2 -> {5, 4} and {6, 2}: 9 and 8 tokens
    assert step.partitions == [[0, 1], [2, 3]]
    rank0, rank1 = step.rank_batches
    assert rank0.tokens.tolist() == [1, 2, 3, 4, 5, 1, 2, 3, 6]
    assert rank0.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 0]
    torch.testing.assert_close(rank0.advantages, torch.tensor([0, 0, A, A, 0, 0, 0, -A, 0]))
    assert rank1.tokens.tolist() == [5, 6, 7, 8, 9, 10, 5, 6]
    torch.testing.assert_close(rank1.advantages, torch.tensor([-A] * 5 + [0, A, 0]))
    for batch in step.rank_batches:  # denominators of the whole step: 2 + 1 + 5 + 1 tokens
        assert (batch.global_num_tokens, batch.global_num_seqs) == (9.0, 4.0)
    assert step.metrics["rollout/reward/mean"] == pytest.approx(4 / 6)  # every scored sample
    assert step.metrics["buffer/groups_filtered"] == 1.0
    assert step.metrics["rollout/response_length/mean"] == pytest.approx(9 / 4)
    assert buffer.num_ready_groups == 0


def test_rloo_and_reward_mapping():
    buffer = DataBuffer(group_size=4, num_ranks=1, advantage_estimator="rloo", reward_key="acc")
    rewards = [1.0, 0.0, 0.0, 1.0]
    buffer.add(sample(0, i, [1, 2, 3], 2, {"acc": r, "fmt": 1.0}) for i, r in enumerate(rewards))
    (batch,) = buffer.pop_step(1).rank_batches
    third = 2 / 3  # r_i - mean of the other three
    expected = [
        v for s in (third, -third, -third, third) for v in (s, s, 0)
    ]  # prediction at position
    torch.testing.assert_close(batch.advantages, torch.tensor(expected))
    with pytest.raises(ValueError, match=r"set algorithm\.reward_key"):
        DataBuffer(group_size=1, num_ranks=1).add([sample(0, 0, [1, 2], 1, {"acc": 1.0})])


def test_loss_mask_of_tool_tokens_zeroes_their_advantage():
    buffer = DataBuffer(group_size=2, num_ranks=1, advantage_estimator="dr_grpo")
    first = sample(0, 0, [1, 2, 3, 4, 5], 3, 1.0)
    first.loss_mask = [1, 0, 1]  # the middle token came from a tool
    buffer.add([first, sample(0, 1, [1, 2, 3], 1, 0.0)])
    (batch,) = buffer.pop_step(1).rank_batches
    assert batch.advantages.tolist() == [0, 0.5, 0, 0.5, 0, 0, -0.5, 0]  # r - group mean
    assert batch.global_num_tokens == 3.0


def test_aborted_groups_are_dropped_and_counted():
    buffer = DataBuffer(group_size=2, num_ranks=3)
    buffer.add([sample(0, 0, [1, 2], 1, 1.0), sample(0, 1, [1, 2], 1, 0.0, status="aborted")])
    buffer.add([sample(1, 0, [1, 2], 1, 1.0), sample(1, 1, [1, 2, 3], 2, 0.0, status="truncated")])
    step = buffer.pop_step(1)
    assert (
        step.metrics["buffer/groups_aborted"] == 1.0
        and step.metrics["rollout/truncated_frac"] == 0.5
    )
    assert sorted(i for part in step.partitions for i in part) == [0, 1]  # third rank gets nothing
    assert sum(b.num_seqs for b in step.rank_batches) == 2
    with pytest.raises(ValueError, match=r"asked for 1 groups, 0 are ready"):
        buffer.pop_step(1)


def test_rank_split_keeps_every_token_once_and_balances():
    buffer = DataBuffer(group_size=2, num_ranks=4)
    lengths = [9, 3, 7, 7, 2, 4, 8, 6]
    buffer.add(
        sample(i // 2, i % 2, list(range(n)), 1, float(i % 2)) for i, n in enumerate(lengths)
    )
    step = buffer.pop_step(4)
    assert sorted(i for part in step.partitions for i in part) == list(range(8))
    assert sum(b.num_tokens for b in step.rank_batches) == sum(lengths)
    assert (
        max(b.num_tokens for b in step.rank_batches) == 13
    )  # optimum: 9, 8, 7, 7 need a rank each and 6 joins one
    full_sum = sum(float((b.advantages * b.loss_mask).sum()) for b in step.rank_batches)
    assert full_sum == pytest.approx(0.0, abs=1e-5)  # GRPO advantages of each group sum to 0


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        DataBuffer(group_size=2, num_ranks=1, advantage_estimator="ppo")
    with pytest.raises(ValueError, match="unknown group filter"):
        DataBuffer(group_size=2, num_ranks=1, group_filter="nope")


def reward_failure(group, index, tokens):
    """A sample whose reward failed and was skipped: aborted, with the error kept."""
    failed = sample(group, index, tokens, len(tokens) - 1, 0.0, status="aborted")
    failed.metadata["reward_error"] = "reward 'r' failed on sample ...: RuntimeError: boom"
    return failed


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_a_failed_reward_skips_its_sample_not_its_group(estimator):
    """Group 0: 4 samples, one whose reward failed: it trains on the other 3, advantages
    taken over them alone. Group 1: only one scored: dropped and counted. Group 2: full."""
    buffer = DataBuffer(group_size=4, num_ranks=1, advantage_estimator=estimator)
    buffer.add(
        [
            sample(0, 0, [1, 2], 1, 1.0),
            reward_failure(0, 1, [1, 3]),
            sample(0, 2, [1, 4], 1, 0.0),
            sample(0, 3, [1, 5], 1, 0.0),
        ]
    )
    buffer.add([reward_failure(1, i, [2, 3]) for i in range(3)] + [sample(1, 3, [2, 4], 1, 1.0)])
    buffer.add(sample(2, i, [3, 4], 1, float(i % 2)) for i in range(4))
    assert buffer.num_ready_groups == 2
    step = buffer.pop_step(2)
    assert [(s.group_index, s.index) for s in step.samples] == [(0, 0), (0, 2), (0, 3)] + [
        (2, i) for i in range(4)
    ]
    assert step.group_sizes == [3, 4]
    assert step.metrics["rollout/groups_dropped_reward_error"] == 1.0
    assert step.metrics["buffer/groups_aborted"] == 0.0  # the engine aborted nothing
    (batch,) = step.rank_batches
    trained = batch.advantages[0::2]  # each sample: 2 tokens, its response predicted at 0
    std3, std4 = math.sqrt(1 / 3), math.sqrt(1 / 3)  # {1, 0, 0} and {0, 1, 0, 1}, unbiased
    expected = {  # the first group over its 3 scored samples, not 4 with a made-up 0
        "grpo": [2 / 3 / std3, -1 / 3 / std3, -1 / 3 / std3] + [-0.5 / std4, 0.5 / std4] * 2,
        "dr_grpo": [2 / 3, -1 / 3, -1 / 3] + [-0.5, 0.5] * 2,
        "rloo": [1.0, -0.5, -0.5] + [-2 / 3, 2 / 3] * 2,
    }[estimator]
    torch.testing.assert_close(trained, torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_groups_left_with_too_few_scored_samples_are_counted_in_the_step_they_end():
    buffer = DataBuffer(group_size=2, num_ranks=1)
    buffer.add([reward_failure(0, 0, [1, 2]), sample(0, 1, [1, 2], 1, 1.0)])
    buffer.add([reward_failure(1, 0, [1, 2]), reward_failure(1, 1, [1, 2])])
    assert buffer.num_ready_groups == 0
    assert buffer.take_counts()["rollout/groups_dropped_reward_error"] == 2.0
    assert buffer.take_counts()["rollout/groups_dropped_reward_error"] == 0.0  # taken once
    single = DataBuffer(group_size=1, num_ranks=1, advantage_estimator="reinforce_plus_plus")
    single.add([reward_failure(0, 0, [1, 2]), sample(1, 0, [1, 2], 1, 1.0)])
    assert single.num_ready_groups == 1  # a group of one needs its one sample


def test_an_engine_abort_still_drops_the_whole_group():
    buffer = DataBuffer(group_size=3, num_ranks=1)
    buffer.add(
        [
            sample(0, 0, [1, 2], 1, 1.0),
            reward_failure(0, 1, [1, 2]),
            sample(0, 2, [1, 2], 1, 0.0, status="aborted"),
        ]
    )
    assert buffer.num_ready_groups == 0
    counts = buffer.take_counts()
    assert counts["buffer/groups_aborted"] == 1.0
    assert counts["rollout/groups_dropped_reward_error"] == 0.0


def test_a_forked_episode_makes_its_group_uneven_and_the_advantages_span_its_leaves():
    buffer = DataBuffer(group_size=2, num_ranks=1)
    # episode 0 forked into two leaves (same sample index), episode 1 did not
    forked = [
        sample(0, 0, [1, 2, 3], 1, 1.0),
        sample(0, 0, [1, 2, 4], 1, 1.0),
        sample(0, 1, [1, 2, 5], 1, 0.0),
    ]
    buffer.add_groups([forked, [sample(1, 0, [6, 7], 1, 0.0), sample(1, 1, [6, 8], 1, 1.0)]])
    step = buffer.pop_step(2)
    assert step.group_sizes == [3, 2] and [s.tokens[-1] for s in step.samples] == [3, 4, 5, 7, 8]
    up = (1 / 3) / (math.sqrt(1 / 3) + 1e-6)  # rewards {1, 1, 0}: mean 2/3, unbiased std √⅓
    expected = [0, up, 0, 0, up, 0, 0, -2 * up, 0, -A, 0, A, 0]  # one response token each
    torch.testing.assert_close(step.rank_batches[0].advantages, torch.tensor(expected))
    with pytest.raises(ValueError, match="one prompt per group"):
        buffer.add_groups([[sample(2, 0, [1, 2], 1, 1.0), sample(3, 1, [1, 2], 1, 0.0)]])
