"""DPO/IPO and on-policy distillation against values computed by hand."""

import math

import pytest
import torch

from rl_core.distill import opd_advantages
from rl_core.preference import dpo_loss, sequence_log_probs

D = torch.float64


def t(*values):
    return torch.tensor(values, dtype=D)


def test_sequence_log_probs_sums_or_averages_masked_tokens():
    lp = t(-1.0, -2.0, -3.0, -0.5, -0.25, -9.0).reshape(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert sequence_log_probs(lp, mask).tolist() == [-3.0, -9.75]
    assert sequence_log_probs(lp, mask, average=True).tolist() == [-1.5, -3.25]
    with pytest.raises(ValueError, match="no response tokens"):
        sequence_log_probs(lp, torch.tensor([[0, 0, 0], [1, 1, 1]]))


def test_dpo_sigmoid_by_hand():
    # pair 0: margin = (-1 - -3) - (-2 - -2.5) = 2 - 0.5 = 1.5
    # pair 1: margin = (-4 - -1) - (-3 - -1) = -3 + 2 = -1
    loss, metrics = dpo_loss(t(-1.0, -4.0), t(-3.0, -1.0), t(-2.0, -3.0), t(-2.5, -1.0), beta=0.5)
    expected = [math.log1p(math.exp(-0.5 * 1.5)), math.log1p(math.exp(-0.5 * -1.0))]
    assert loss.dtype == D
    assert loss.tolist() == pytest.approx(expected, abs=1e-12)
    # implicit rewards: 0.5 * (chosen - ref): [0.5, -0.5]; rejected: [-0.25, 0]
    assert metrics["pref/chosen_reward"].item() == pytest.approx(0.0)
    assert metrics["pref/rejected_reward"].item() == pytest.approx(-0.125)
    assert metrics["pref/margin"].item() == pytest.approx(0.5 * (1.5 - 1.0) / 2)
    assert metrics["pref/accuracy"].item() == 0.5


def test_dpo_label_smoothing_mixes_both_directions():
    loss, _ = dpo_loss(t(0.0), t(-2.0), t(0.0), t(0.0), beta=1.0, label_smoothing=0.1)
    sp = lambda x: math.log1p(math.exp(x))  # noqa: E731  -log sigmoid(-x) = softplus(x)
    assert loss.item() == pytest.approx(0.9 * sp(-2.0) + 0.1 * sp(2.0), abs=1e-12)


def test_ipo_is_squared_distance_to_half_inverse_beta():
    loss, _ = dpo_loss(t(-1.0, 0.0), t(-2.0, 0.0), t(0.0, 0.0), t(0.0, 0.0), beta=0.25, kind="ipo")
    assert loss.tolist() == pytest.approx([(1.0 - 2.0) ** 2, (0.0 - 2.0) ** 2])


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    chosen, rejected = t(-1.0).requires_grad_(), t(-1.0).requires_grad_()
    loss, _ = dpo_loss(chosen, rejected, t(-1.0), t(-1.0), beta=0.1)
    loss.sum().backward()
    assert chosen.grad.item() == pytest.approx(-0.05)  # -beta * sigmoid(0)
    assert rejected.grad.item() == pytest.approx(0.05)
    args = [torch.randn(4, dtype=D, requires_grad=True) for _ in range(2)]
    refs = [torch.randn(4, dtype=D) for _ in range(2)]
    for kind in ("sigmoid", "ipo"):
        assert torch.autograd.gradcheck(
            lambda c, r, k=kind: dpo_loss(c, r, *refs, kind=k)[0], tuple(args)
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "kto"}, "known sigmoid, ipo"),
        ({"beta": 0.0}, "beta must be > 0"),
        ({"label_smoothing": 0.5}, r"\[0, 0.5\)"),
        ({"kind": "ipo", "label_smoothing": 0.1}, "sigmoid loss only"),
    ],
)
def test_dpo_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dpo_loss(t(0.0), t(0.0), t(0.0), t(0.0), **kwargs)


def test_opd_subtracts_scaled_reverse_kl_per_token():
    adv = t(1.0, 1.0, 1.0, -0.5, -0.5, -0.5).reshape(2, 3)
    student = t(-0.5, -1.0, -2.0, -0.1, -0.2, -7.0).reshape(2, 3)
    teacher = t(-1.5, -0.5, -2.0, -0.1, -1.2, -0.0).reshape(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    shaped, metrics = opd_advantages(adv, student, teacher, mask, coef=0.5)
    # reverse KL per token: [1.0, -0.5, 0.0], [0.0, 1.0, (masked)]
    assert shaped.tolist() == [[0.5, 1.25, 1.0], [-0.5, -1.0, 0.0]]
    assert metrics["opd/reverse_kl"] == pytest.approx(1.5 / 5)
    assert metrics["opd/teacher_log_prob"] == pytest.approx(-5.3 / 5)
    with pytest.raises(ValueError, match=">= 0"):
        opd_advantages(adv, student, teacher, mask, coef=-1.0)


def test_opd_whitens_the_sum_of_advantage_and_teacher_term_as_slime_normalize_advantages():
    adv = t(1.0, 0.0, 0.0, 0.0).reshape(2, 2)
    student = t(-1.0, -1.0, -2.0, 5.0).reshape(2, 2)
    teacher = t(-1.0, -2.0, -1.0, 0.0).reshape(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    shaped, _ = opd_advantages(adv, student, teacher, mask, coef=1.0, whiten=True)
    # sum: [1 - 0, 0 - 1], [0 + 1, masked] = 1, -1, 1; mean 1/3, unbiased variance 4/3
    root3 = math.sqrt(3.0)
    expected = t(1 / root3, -2 / root3, 1 / root3, 0.0).reshape(2, 2)
    torch.testing.assert_close(shaped, expected, atol=1e-6, rtol=0)


def test_opd_does_not_differentiate_through_the_student_log_probs():
    student = t(-1.0, -2.0).requires_grad_()
    shaped, _ = opd_advantages(t(0.0, 0.0), student, t(-1.0, -1.0), torch.ones(2))
    assert not shaped.requires_grad
