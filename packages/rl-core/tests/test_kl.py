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
