import pytest
import torch

from rl_core.cp import padded_length, zigzag_gather, zigzag_positions, zigzag_ranges, zigzag_slice


def test_ranges_by_hand():
    # 16 tokens, cp 2 -> 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_ranges(16, cp_size=2, cp_rank=0) == [(0, 4), (12, 16)]
    assert zigzag_ranges(16, cp_size=2, cp_rank=1) == [(4, 8), (8, 12)]
    assert zigzag_ranges(12, cp_size=3, cp_rank=2) == [(4, 6), (6, 8)]
    assert zigzag_ranges(7, cp_size=1, cp_rank=0) == [(0, 7)]


def test_bad_layouts():
    with pytest.raises(ValueError, match="pad it to 16"):
        zigzag_ranges(14, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="cp_rank"):
        zigzag_ranges(16, cp_size=2, cp_rank=2)
    assert padded_length(14, cp_size=2) == 16
    assert padded_length(14, cp_size=1) == 14


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_slice_then_gather_is_identity(cp_size):
    seq_len = 8 * cp_size
    full = torch.randn(2, seq_len, 3)
    shards = [zigzag_slice(full, cp_size=cp_size, cp_rank=r, dim=1) for r in range(cp_size)]
    assert all(s.shape == (2, seq_len // cp_size, 3) for s in shards)
    torch.testing.assert_close(zigzag_gather(shards, dim=1), full)


def test_every_position_held_once_and_work_balanced():
    seq_len, cp_size = 32, 4
    positions = [zigzag_positions(seq_len, cp_size=cp_size, cp_rank=r) for r in range(cp_size)]
    assert sorted(torch.cat(positions).tolist()) == list(range(seq_len))
    # causal attention work of a token ~ its position + 1: every rank gets the same total
    work = [int((p + 1).sum()) for p in positions]
    assert len(set(work)) == 1
