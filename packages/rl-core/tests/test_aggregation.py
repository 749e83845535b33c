import pytest
import torch

from rl_core.losses import aggregate

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_modes_by_hand():
    assert aggregate(X, MASK).item() == pytest.approx(10 / 4)
    assert aggregate(X, MASK, mode="seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(X, MASK, mode="seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    norm = aggregate(X, MASK, mode="seq-mean-token-sum-norm").item()
    assert norm == pytest.approx((6 / 3 + 4 / 3) / 2)
    assert aggregate(X, MASK, mode="seq-mean-token-sum-norm", norm_length=2).item() == 2.5


def test_explicit_denominators():
    assert aggregate(X, MASK, num_tokens=8).item() == pytest.approx(10 / 8)
    assert aggregate(X, MASK, mode="seq-mean-token-sum", num_seqs=5).item() == pytest.approx(2.0)


def test_empty_mask_gives_zero_not_nan():
    assert aggregate(X, torch.zeros_like(MASK)).item() == 0.0
    assert aggregate(X, torch.zeros_like(MASK), mode="seq-mean-token-mean").item() == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batches_with_global_denominators_sum_to_full_batch(mode):
    torch.manual_seed(0)
    x = torch.randn(8, 5, requires_grad=True)
    mask = (torch.rand(8, 5) > 0.3).float()
    mask[3] = 0
    full = aggregate(x, mask, mode=mode)
    (full_grad,) = torch.autograd.grad(full, x)
    num_tokens, num_seqs = mask.sum(), (mask.sum(1) > 0).sum()
    parts = [
        aggregate(
            x[i : i + 3], mask[i : i + 3], mode=mode, num_tokens=num_tokens, num_seqs=num_seqs
        )
        for i in range(0, 8, 3)
    ]
    total = sum(parts)
    (part_grad,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(part_grad, full_grad)


def test_packed_equals_padded():
    keep = MASK.bool() | torch.tensor([[0, 0, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    # packed rows have lengths 3, 2, 1 including some masked-out tokens
    packed_x, packed_mask = X[keep], MASK[keep]
    cu = torch.tensor([0, 3, 5, 6])
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        expected = aggregate(X, MASK, mode=mode)
        got = aggregate(packed_x, packed_mask, mode=mode, cu_seqlens=cu)
        torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(packed_x, packed_mask, mode="seq-mean-token-sum-norm", cu_seqlens=cu)


def test_unknown_mode():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(X, MASK, mode="sum")


def test_segment_ids_with_a_known_size_never_reads_the_device_back():
    from rl_core.aggregation import segment_ids

    cu = torch.tensor([0, 2, 2, 5])
    assert segment_ids(cu).tolist() == [0, 0, 2, 2, 2]
    assert segment_ids(cu, 5).tolist() == [0, 0, 2, 2, 2]
    with pytest.raises(ValueError, match="covers 5 tokens but the tensor has 6"):
        segment_ids(cu, 6)
    on_meta = segment_ids(cu.to("meta"), 5)  # 'meta' raises on any read-back
    assert on_meta.shape == (5,) and on_meta.device.type == "meta"
