"""sdpa_grouped: sequences padded into a few batched causal SDPA calls equal one call per
sequence, forward and backward, whatever the mix of lengths."""

import pytest
import torch
import torch.nn.functional as F

from rl_core.packing import cu_seqlens_from_lengths
from rl_fsdp.attention import PER_DOC_UP_TO, PackedLayout
from rl_fsdp.grouped import build_groups, group_by_length, grouped_attention


def test_groups_hold_lengths_within_a_factor_two_of_their_longest():
    lengths = (5, 40, 0, 21, 19, 10, 3, 80)
    # 80,40 | 21,19 | 10,5 | 3 (10 < 21 / 2 opens a group; 3 < 10 / 2 too)
    assert group_by_length(lengths) == [[7, 1], [3, 4], [5, 0], [6]]
    assert group_by_length(()) == []


def per_sequence(query, key, value, lengths):
    parts = zip(*(t.split(lengths, dim=2) for t in (query, key, value)), strict=True)
    return torch.cat(
        [F.scaled_dot_product_attention(q, k, v, is_causal=True) for q, k, v in parts], dim=2
    )


@pytest.mark.parametrize("lengths", [(7,), (3, 17, 1, 9, 33, 2, 16), (64, 1, 1, 63)])
def test_grouped_equals_one_call_per_sequence_forward_and_backward(lengths):
    torch.manual_seed(0)
    heads, dim, n = 3, 8, sum(lengths)
    qkv = [torch.randn(1, heads, n, dim, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    groups, restore = build_groups(lengths, "cpu")
    assert len(groups) <= len(lengths)
    got = grouped_attention(*qkv, groups, restore, scaling=None, dropout=0.0)
    want = per_sequence(*qkv, list(lengths))
    torch.testing.assert_close(got, want)
    weights = torch.randn_like(want)
    got_grads = torch.autograd.grad((got * weights).sum(), qkv)
    want_grads = torch.autograd.grad((want * weights).sum(), qkv)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_hundreds_of_short_sequences_take_a_few_calls():
    lengths = tuple(16 + (7 * i) % 60 for i in range(600))  # RL-like: 16..75 tokens
    groups, restore = build_groups(lengths, "cpu")
    assert len(groups) <= 3
    assert sorted(restore.tolist()) == list(range(sum(lengths)))


def test_a_few_sequences_keep_one_call_each_many_are_grouped():
    few = cu_seqlens_from_lengths([900, 30, 4000])
    many = cu_seqlens_from_lengths([20 + i for i in range(PER_DOC_UP_TO + 1)])
    assert PackedLayout.from_cu_seqlens(few, "sdpa_grouped", "cpu").impl == "sdpa_per_doc"
    layout = PackedLayout.from_cu_seqlens(many, "sdpa_grouped", "cpu")
    assert layout.impl == "sdpa_grouped" and len(layout.groups) == 1
