import math

import pytest
import torch

from rl_core.kl import approx_kl


def test_each_kind_by_hand():
    log_probs = torch.tensor([0.0, -1.0, -2.0])
    ref_log_probs = torch.tensor([0.0, -2.0, -1.0])
    d = [0.0, 1.0, -1.0]
    torch.testing.assert_close(approx_kl(log_probs, ref_log_probs, kind="k1"), torch.tensor(d))
    torch.testing.assert_close(
        approx_kl(log_probs, ref_log_probs, kind="k2"), torch.tensor([0.0, 0.5, 0.5])
    )
    k3 = [math.exp(-x) - 1 + x for x in d]  # [0, e^-1, e - 2]
    torch.testing.assert_close(approx_kl(log_probs, ref_log_probs), torch.tensor(k3))


def test_low_var_kl_clamps_at_ten():
    log_probs = torch.tensor([-20.0, 0.0])
    ref_log_probs = torch.tensor([0.0, 0.5])
    out = approx_kl(log_probs, ref_log_probs, kind="low_var_kl")
    assert out[0].item() == 10.0  # k3 = e^20 - 21, clamped
    assert out[1].item() == pytest.approx(math.exp(0.5) - 1.5, rel=1e-6)


def test_k3_is_non_negative_and_zero_at_equality():
    x = torch.randn(1000)
    y = torch.randn(1000)
    assert (approx_kl(x, y) >= 0).all()
    assert approx_kl(x, x).abs().max() == 0


def test_unknown_kind_lists_choices():
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl"):
        approx_kl(torch.zeros(1), torch.zeros(1), kind="k4")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_float64_in_float64_out_and_gradcheck(kind):
    generator = torch.Generator().manual_seed(0)
    log_probs = (torch.randn(6, generator=generator, dtype=torch.float64) - 1).requires_grad_()
    ref = (torch.randn(6, generator=generator, dtype=torch.float64) - 1).requires_grad_()
    assert approx_kl(log_probs, ref, kind=kind).dtype == torch.float64
    assert approx_kl(log_probs.bfloat16(), ref.bfloat16(), kind=kind).dtype == torch.float32
    assert torch.autograd.gradcheck(lambda a, b: approx_kl(a, b, kind=kind), (log_probs, ref))


@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
def test_absurd_masked_log_ratio_gives_no_nan(kind):
    """A masked token with log pi - log pi_ref = -99 (exp overflows float32) must neither
    make the masked loss NaN nor send a NaN gradient into the weights (verl's +-20 guard)."""
    log_probs = torch.tensor([-100.0, -1.0, -30.0], requires_grad=True)
    ref_log_probs = torch.tensor([-1.0, -1.2, -1.0])
    mask = torch.tensor([0.0, 1.0, 0.0])
    kl = approx_kl(log_probs, ref_log_probs, kind=kind)
    loss = (kl * mask).sum()
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_probs.grad).all()
    # the valid token is untouched: d = 0.2 -> e^-0.2 - 1 + 0.2, gradient 1 - e^-0.2
    assert loss.item() == pytest.approx(math.exp(-0.2) - 0.8, rel=1e-5)
    assert log_probs.grad.tolist() == pytest.approx([0.0, 1 - math.exp(-0.2), 0.0], rel=1e-5)
    assert kl[0].item() == (10.0 if kind == "low_var_kl" else pytest.approx(math.exp(20) - 21))
