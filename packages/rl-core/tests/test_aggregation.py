import pytest
import torch

from rl_core.aggregation import AGGREGATION_MODES
from rl_core.losses import aggregate
from rl_core.packing import pack

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_modes_by_hand():
    # row sums 6, 4, (0: fully masked); row counts 3, 1, 0; padded width T = 3
    assert aggregate(X, MASK).item() == pytest.approx(10 / 4)
    assert aggregate(X, MASK, mode="seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(X, MASK, mode="seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    norm = aggregate(X, MASK, mode="seq-mean-token-sum-norm").item()
    assert norm == pytest.approx((6 + 4) / 3)  # the horizon only, no division by 2 sequences
    assert aggregate(X, MASK, mode="seq-mean-token-sum-norm", norm_length=2).item() == 5.0


def test_seq_mean_token_sum_norm_is_dr_grpo_by_hand():
    """Dr.GRPO: every token's loss counts alike, over one constant horizon (here 4)."""
    per_token = torch.tensor([[0.5, -1.0, 0.0, 0.0], [2.0, 1.0, 3.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # (0.5 - 1.0) + (2 + 1 + 3 - 0.5) = 5.0 over the horizon 4
    got = aggregate(per_token, mask, mode="seq-mean-token-sum-norm")
    assert got.item() == pytest.approx(5.0 / 4)
    # a doubled batch sums twice the tokens: the loss doubles (no mean over sequences)
    doubled = aggregate(per_token.repeat(2, 1), mask.repeat(2, 1), mode="seq-mean-token-sum-norm")
    assert doubled.item() == pytest.approx(2 * 5.0 / 4)
    # num_seqs plays no part; a wider horizon divides by more
    assert aggregate(per_token, mask, mode="seq-mean-token-sum-norm", num_seqs=7).item() == (
        pytest.approx(5.0 / 4)
    )
    assert aggregate(per_token, mask, mode="seq-mean-token-sum-norm", norm_length=10).item() == (
        pytest.approx(0.5)
    )
    with pytest.raises(ValueError, match="norm_length must be positive"):
        aggregate(per_token, mask, mode="seq-mean-token-sum-norm", norm_length=0)


def test_each_mode_matches_verls_agg_loss_by_hand():
    """verl's agg_loss, written out for this batch (dp_size 1):
    token-mean = masked sum / batch_num_tokens; seq-mean-token-sum = sum of row sums over
    non-empty rows / global_batch_size; seq-mean-token-mean = sum of row sum / (row count +
    1e-8) / global_batch_size; seq-mean-token-sum-norm = sum of row sums / loss_scale_factor.
    """
    per_token = torch.tensor([[0.2, 0.4, 0.6, 0.8], [1.0, 2.0, 9.0, 9.0], [3.0, 3.0, 3.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # row sums 2.0, 3.0, 0; row counts 4, 2, 0; 6 valid tokens, 2 non-empty rows, width 4
    expected = {
        "token-mean": (2.0 + 3.0) / 6,
        "seq-mean-token-sum": (2.0 + 3.0) / 2,
        "seq-mean-token-mean": (2.0 / 4 + 3.0 / 2) / 2,
        "seq-mean-token-sum-norm": (2.0 + 3.0) / 4,
    }
    for mode, value in expected.items():
        assert aggregate(per_token, mask, mode=mode).item() == pytest.approx(value), mode
    # the global denominators (verl: batch_num_tokens, global_batch_size, loss_scale_factor)
    given = dict(num_tokens=10, num_seqs=5, norm_length=8)
    expected = {
        "token-mean": 5.0 / 10,
        "seq-mean-token-sum": 5.0 / 5,
        "seq-mean-token-mean": 2.0 / 5,
        "seq-mean-token-sum-norm": 5.0 / 8,
    }
    for mode, value in expected.items():
        assert aggregate(per_token, mask, mode=mode, **given).item() == pytest.approx(value), mode


def test_explicit_denominators():
    assert aggregate(X, MASK, num_tokens=8).item() == pytest.approx(10 / 8)
    assert aggregate(X, MASK, mode="seq-mean-token-sum", num_seqs=5).item() == pytest.approx(2.0)


def test_empty_mask_gives_zero_not_nan():
    assert aggregate(X, torch.zeros_like(MASK)).item() == 0.0
    assert aggregate(X, torch.zeros_like(MASK), mode="seq-mean-token-mean").item() == 0.0


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batches_with_global_denominators_sum_to_full_batch(mode):
    torch.manual_seed(0)
    x = torch.randn(8, 5, requires_grad=True)
    mask = (torch.rand(8, 5) > 0.3).float()
    mask[3] = 0
    mask[5, 3:] = 0
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


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_packed_micro_batches_with_global_denominators_sum_to_padded_batch(mode):
    """Ranks or micro-batches that each pack their own sequences (their own widths) add up
    to the padded full batch, given the global counts and, for the -norm mode, the horizon."""
    torch.manual_seed(1)
    x = torch.randn(7, 6, requires_grad=True)
    lengths = torch.tensor([6, 2, 4, 1, 5, 3, 6])
    in_row = torch.arange(6) < lengths[:, None]
    mask = in_row & (torch.rand(7, 6) > 0.2)
    mask[3] = False  # a sequence with no valid token
    full = aggregate(x, mask, mode=mode)
    (full_grad,) = torch.autograd.grad(full, x)
    denominators = dict(
        num_tokens=mask.sum(), num_seqs=(mask.sum(1) > 0).sum(), norm_length=x.shape[1]
    )
    total = 0.0
    for rows in ([0, 3], [1, 2, 6], [4, 5]):
        keep = in_row[rows]
        packed_x, cu = pack(x[rows], keep)
        packed_mask, _ = pack(mask[rows], keep)
        total = total + aggregate(packed_x, packed_mask, mode=mode, cu_seqlens=cu, **denominators)
    (part_grad,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(part_grad, full_grad)


def test_sum_norm_needs_one_horizon_across_parts():
    """Each part's own padded width as the horizon would not add up: pass norm_length."""
    x = torch.ones(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    full = aggregate(x, mask, mode="seq-mean-token-sum-norm")  # 6 / 4
    own_widths = aggregate(x[:1], mask[:1], mode="seq-mean-token-sum-norm") + aggregate(
        x[1:, :2], mask[1:, :2], mode="seq-mean-token-sum-norm"
    )  # 4 / 4 + 2 / 2
    shared = aggregate(x[:1], mask[:1], mode="seq-mean-token-sum-norm", norm_length=4) + (
        aggregate(x[1:, :2], mask[1:, :2], mode="seq-mean-token-sum-norm", norm_length=4)
    )
    assert (full.item(), own_widths.item(), shared.item()) == (1.5, 2.0, 1.5)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_float64_in_float64_out_and_gradcheck(mode):
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    assert aggregate(x, mask.bool(), mode=mode).dtype == torch.float64
    assert (
        aggregate(
            x.float(), mask, mode=mode, num_tokens=torch.tensor(9.0, dtype=torch.float64)
        ).dtype
        == torch.float32
    )
    x.requires_grad_()
    assert torch.autograd.gradcheck(lambda t: aggregate(t, mask, mode=mode), (x,))


def test_packed_equals_padded():
    keep = MASK.bool() | torch.tensor([[0, 0, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    # packed rows have lengths 3, 2, 1 including some masked-out tokens
    packed_x, packed_mask = X[keep], MASK[keep]
    cu = torch.tensor([0, 3, 5, 6])
    for mode in AGGREGATION_MODES:
        horizon = {"norm_length": 3} if mode == "seq-mean-token-sum-norm" else {}
        expected = aggregate(X, MASK, mode=mode)
        got = aggregate(packed_x, packed_mask, mode=mode, cu_seqlens=cu, **horizon)
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
