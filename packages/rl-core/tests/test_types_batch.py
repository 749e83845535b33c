import pytest
import torch

from rl_core.batch import TrainBatch, batch_from_samples, next_token_targets
from rl_core.types import Sample, SampleStatus, scalar_reward


def make_samples():
    return [
        Sample(
            prompt="1+1=",
            tokens=[5, 6, 7, 8, 9],
            response="2",
            response_length=2,
            loss_mask=[1, 0],
            reward=1.0,
            status="completed",
            rollout_log_probs=[-0.1, -0.2],
            weight_versions=["3"],
            group_index=0,
            index=0,
            label="2",
            metadata={"source": "toy"},
        ),
        Sample(tokens=[1, 2, 3], response_length=1, rollout_log_probs=[-0.3], index=1),
    ]


def test_sample_json_round_trip():
    sample = make_samples()[0]
    restored = Sample.from_json(sample.to_json())
    assert restored == sample
    assert restored.status is SampleStatus.COMPLETED
    assert restored.prompt_length == 3
    with pytest.raises(ValueError, match="unknown Sample fields"):
        Sample.from_dict({"tokens": [], "colour": 1})


def test_sample_validate():
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 response tokens"):
        Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1]).validate()
    with pytest.raises(ValueError, match="response_length 4"):
        Sample(tokens=[1, 2, 3], response_length=4).validate()


def test_batch_from_samples_alignment_by_hand():
    batch = batch_from_samples(make_samples(), advantages=[2.0, [-1.0]])
    assert batch.tokens.tolist() == [5, 6, 7, 8, 9, 1, 2, 3]
    assert batch.cu_seqlens.tolist() == [0, 5, 8]
    # position t predicts token t+1: sample 0's response tokens 8, 9 are predicted at 2, 3
    assert batch.loss_mask.tolist() == [0, 0, 1, 0, 0, 0, 1, 0]
    assert batch.advantages.tolist() == [0, 0, 2, 2, 0, 0, -1, 0]
    torch.testing.assert_close(
        batch.rollout_log_probs, torch.tensor([0, 0, -0.1, -0.2, 0, 0, -0.3, 0])
    )
    assert (batch.global_num_tokens, batch.global_num_seqs) == (2.0, 2.0)
    targets = next_token_targets(batch.tokens, batch.cu_seqlens)
    assert targets.tolist() == [6, 7, 8, 9, 0, 2, 3, 0]


def test_batch_fields_equal_torch_tensor_of_the_same_lists_and_own_their_memory():
    import random

    draw = random.Random(0)
    samples = []
    for index in range(50):
        prompt, response = draw.randint(1, 9), draw.randint(0, 40)
        samples.append(
            Sample(
                tokens=[draw.randrange(2**40) for _ in range(prompt + response)],
                response_length=response,
                rollout_log_probs=[-draw.random() * 30 for _ in range(response)],
                loss_mask=[draw.randint(0, 1) for _ in range(response)],
                index=index,
            )
        )
    advantages = [draw.gauss(0, 1) for _ in samples]
    batch = batch_from_samples(samples, advantages)
    expected_tokens = torch.tensor([t for s in samples for t in s.tokens], dtype=torch.long)
    assert torch.equal(batch.tokens, expected_tokens) and batch.tokens.dtype == torch.long
    for name in ("loss_mask", "advantages", "rollout_log_probs"):
        value = getattr(batch, name)
        assert value.dtype == torch.float32
        assert torch.equal(value, torch.tensor(value.tolist(), dtype=torch.float32))
    starts = batch.host_cu_seqlens.tolist()
    for sample, start in zip(samples, starts, strict=False):  # float32 of each log-prob
        placed = batch.rollout_log_probs[start + sample.prompt_length - 1 :][
            : sample.response_length
        ]
        assert torch.equal(placed, torch.tensor(sample.rollout_log_probs, dtype=torch.float32))
    del samples, advantages
    assert batch.tokens.sum().item() == expected_tokens.sum().item()  # the memory stayed
    empty = batch_from_samples([], [])
    assert empty.tokens.dtype == torch.long and empty.tokens.shape == (0,)
    assert empty.advantages.dtype == torch.float32 and empty.cu_seqlens.tolist() == [0]


def test_next_token_targets_with_empty_sequences_and_without_read_back():
    tokens = torch.tensor([5, 6, 7, 8, 9])
    for cu, expected in [
        ([0, 0, 2, 2, 5], [6, 0, 8, 9, 0]),  # empty first and middle sequences
        ([0, 2, 5, 5], [6, 0, 8, 9, 0]),  # empty last sequence
        ([0, 0, 0, 5], [6, 7, 8, 9, 0]),
    ]:
        assert next_token_targets(tokens, torch.tensor(cu)).tolist() == expected, cu
    assert next_token_targets(torch.zeros(0, dtype=torch.long), torch.tensor([0, 0])).numel() == 0
    on_meta = next_token_targets(tokens.to("meta"), torch.tensor([0, 2, 5]).to("meta"))
    assert on_meta.shape == (5,) and on_meta.is_meta  # 'meta' raises on any read-back


def test_select_keeps_global_denominators_and_validates():
    batch = batch_from_samples(make_samples(), advantages=[1.0, 1.0])
    part = batch.select([1])
    assert part.tokens.tolist() == [1, 2, 3]
    assert part.cu_seqlens.tolist() == [0, 3]
    assert part.global_num_tokens == 2.0
    assert batch.select([]).num_tokens == 0
    with pytest.raises(ValueError, match="loss_mask has shape"):
        TrainBatch(tokens=torch.zeros(3), cu_seqlens=torch.tensor([0, 3]), loss_mask=torch.ones(2))
    with pytest.raises(ValueError, match="cu_seqlens ends at 2"):
        TrainBatch(tokens=torch.zeros(3), cu_seqlens=torch.tensor([0, 2]), loss_mask=torch.ones(3))


def test_select_gathers_the_tokens_of_the_sequences_in_order_or_returns_the_batch():
    """Any order and subset (hand-checked boundaries); all sequences in order is the batch
    itself (no gather, no host-to-device copy of a token index)."""
    tokens = torch.arange(10)
    batch = TrainBatch(
        tokens=tokens,
        cu_seqlens=torch.tensor([0, 3, 4, 8, 10]),  # lengths 3, 1, 4, 2
        loss_mask=torch.ones(10),
        advantages=tokens.float() * 10,
    )
    part = batch.select([2, 0, 3])
    assert part.tokens.tolist() == [4, 5, 6, 7, 0, 1, 2, 8, 9]
    assert part.advantages.tolist() == [40.0, 50.0, 60.0, 70.0, 0.0, 10.0, 20.0, 80.0, 90.0]
    assert part.cu_seqlens.tolist() == [0, 4, 7, 9]
    assert batch.select([1]).tokens.tolist() == [3]
    assert batch.select(range(4)) is batch
    assert batch.select([0, 1, 2, 3]) is batch
    assert batch.select([1, 0, 2, 3]).tokens.tolist() == [3, 0, 1, 2, 4, 5, 6, 7, 8, 9]


def test_device_batch_splits_without_reading_the_device():
    """On 'meta' every read-back raises: moving, lengths and select must use the host copy."""
    batch = batch_from_samples(make_samples(), advantages=[1.0, 1.0])
    on_meta = batch.to("meta")
    assert on_meta.tokens.is_meta and on_meta.cu_seqlens.is_meta
    assert on_meta.host_cu_seqlens.tolist() == [0, 5, 8]
    assert on_meta.seq_lengths() == [5, 3]
    part = on_meta.select([1, 0])
    assert part.tokens.is_meta and part.tokens.shape == (8,)
    assert part.host_cu_seqlens.tolist() == [0, 3, 8] and part.cu_seqlens.is_meta
    assert part.loss_mask.shape == (8,) and part.global_num_tokens == 2.0
    # the same selection on the host gives those boundaries and tokens
    on_host = batch.select([1, 0])
    assert on_host.cu_seqlens.tolist() == [0, 3, 8]
    assert on_host.tokens.tolist() == [1, 2, 3, 5, 6, 7, 8, 9]


def test_new_device_boundaries_are_read_back_not_trusted():
    """replace() with other device boundaries must not keep the old host copy."""
    from dataclasses import replace

    on_meta = batch_from_samples(make_samples()).to("meta")
    with pytest.raises(NotImplementedError):  # it tries to read the new boundaries
        replace(on_meta, cu_seqlens=torch.tensor([0, 4, 8], device="meta"))
    assert replace(on_meta, advantages=None).host_cu_seqlens.tolist() == [0, 5, 8]


def test_scalar_reward_reads_numbers_mappings_and_refuses_a_missing_reward():
    assert scalar_reward(Sample(tokens=[1], reward=0.5)) == 0.5
    assert scalar_reward(Sample(tokens=[1], reward={"acc": 1, "fmt": 0.25}), "fmt") == 0.25
    unscored = Sample(tokens=[1], index=4, group_index=1)
    with pytest.raises(ValueError, match="sample 1/4 has no reward"):
        scalar_reward(unscored)
    assert scalar_reward(unscored, unscored=0.0) == 0.0  # an aborted sample in a group filter
