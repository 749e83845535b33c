"""The static runner's decode pieces against their plain definitions, and slot compaction."""

import torch

from rl_sglang.engine.layers import attend, rms_norm, rotate, signed_sin


def test_rotate_equals_rotate_half_bit_for_bit():
    torch.manual_seed(0)
    x, cos, sin = torch.randn(3, 5, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    rotate_half = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
    assert torch.equal(rotate(x, cos, signed_sin(sin)), x * cos + rotate_half * sin)


def test_grouped_attention_equals_repeated_heads():
    """Query head h reads KV head h // G, as HF's repeat_kv does; masked columns are
    ignored, so garbage there must not change the result."""
    torch.manual_seed(0)
    batch, num_q, num_kv, length, dim = 2, 6, 2, 5, 4
    q = torch.randn(batch, num_q, dim)
    keys, values = torch.randn(batch, num_kv, length, dim), torch.randn(batch, num_kv, length, dim)
    visible = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    mask = torch.zeros(batch, length).masked_fill(~visible, float("-inf"))[:, None, None, :]
    out = attend(q, keys, values, mask)
    group = num_q // num_kv
    for b in range(batch):
        for h in range(num_q):
            k, v = keys[b, h // group, visible[b]], values[b, h // group, visible[b]]
            weights = torch.softmax(k @ q[b, h] / dim**0.5, dim=0)
            expected = weights @ v
            assert torch.allclose(out[b, h * dim : (h + 1) * dim], expected, atol=1e-5)
    keys[0, :, 3:] = 1e4  # hidden columns of row 0
    assert torch.allclose(attend(q, keys, values, mask), out, atol=1e-6)


def test_rms_norm_by_hand():
    norm = torch.nn.Module()
    norm.weight, norm.variance_epsilon = torch.tensor([1.0, 2.0]), 0.0
    # x = [3, 4]: rms = sqrt((9 + 16) / 2) = sqrt(12.5)
    out = rms_norm(norm, torch.tensor([[3.0, 4.0]]))
    expected = torch.tensor([[3.0, 8.0]]) / 12.5**0.5
    assert torch.allclose(out, expected)


def test_fill_holes_moves_only_rows_past_the_end():
    from rl_sglang.engine.rows import fill_holes

    assert fill_holes([0, 1, 3, 4]) == [0, 1, 4, 3]  # row 4 fills hole 2; row 3 stays
    assert fill_holes([2, 5, 0]) == [0, 5, 2]
    assert fill_holes([0, 1, 2]) == [0, 1, 2]
    assert fill_holes([4, 3]) == [4, 3]
