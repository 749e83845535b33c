import math

import pytest
import torch

from rl_core.losses import (
    POLICY_LOSSES,
    aggregate,
    cispo_loss,
    entropy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
    sft_loss,
    value_loss,
)


def test_ppo_by_hand():
    # ratios 1.5, 0.5, 1.1, 0.7 with A = +1, +1, -1, -1 and clip 0.2
    ratios = torch.tensor([1.5, 0.5, 1.1, 0.7])
    old = torch.zeros(4)
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipfrac = ppo_policy_loss(ratios.log(), old, advantages, clip_low=0.2)
    # A>0: max(-r, -clip(r)) -> r=1.5: max(-1.5,-1.2)=-1.2 (clipped); r=0.5: max(-0.5,-0.8)=-0.5
    # A<0: max(r, clip(r)) -> r=1.1: 1.1 (inside); r=0.7: max(0.7, 0.8) = 0.8 (clipped)
    torch.testing.assert_close(loss, torch.tensor([-1.2, -0.5, 1.1, 0.8]))
    torch.testing.assert_close(clipfrac, torch.tensor([1.0, 0.0, 0.0, 1.0]))


def test_ppo_clip_higher_is_asymmetric():
    loss, clipfrac = ppo_policy_loss(
        torch.tensor([1.25]).log(), torch.zeros(1), torch.ones(1), clip_low=0.2, clip_high=0.28
    )
    torch.testing.assert_close(loss, torch.tensor([-1.25]))
    assert clipfrac.item() == 0.0


def test_ppo_dual_clip_bounds_negative_advantage():
    # r = 5, A = -1: plain loss = max(5, 1.2) = 5; dual clip c=3 caps it at -c·A = 3.
    loss, _ = ppo_policy_loss(
        torch.tensor([5.0]).log(), torch.zeros(1), -torch.ones(1), clip_low=0.2, dual_clip=3.0
    )
    torch.testing.assert_close(loss, torch.tensor([3.0]))
    # positive advantages are untouched by dual clip
    loss_pos, _ = ppo_policy_loss(
        torch.tensor([5.0]).log(), torch.zeros(1), torch.ones(1), clip_low=0.2, dual_clip=3.0
    )
    torch.testing.assert_close(loss_pos, torch.tensor([-1.2]))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), dual_clip=0.5)


def test_ppo_gradient_is_zero_when_clipped():
    log_probs = torch.tensor([math.log(1.5), math.log(1.1)], requires_grad=True)
    loss, _ = ppo_policy_loss(log_probs, torch.zeros(2), torch.ones(2), clip_low=0.2)
    loss.sum().backward()
    # d(-A r)/d logp = -A r: clipped token gets 0, the other -1.1
    torch.testing.assert_close(log_probs.grad, torch.tensor([0.0, -1.1]))


def test_gspo_sequence_ratio_and_token_gradient():
    # Row 0: log-ratios 0.2, 0.0 (masked third) -> mean 0.1 -> s = e^0.1, inside the clip range.
    log_probs = torch.tensor([[0.2, 0.0, 5.0], [0.0, 0.0, 0.0]], requires_grad=True)
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, clipfrac = gspo_policy_loss(log_probs, old, advantages, mask, clip_low=0.2, clip_high=0.2)
    s0 = math.exp(0.1)
    torch.testing.assert_close(loss[0, :2], torch.tensor([-s0, -s0]))
    torch.testing.assert_close(loss[1], torch.ones(3))
    assert clipfrac.sum().item() == 0.0
    (loss * mask).sum().backward()
    # gradient of -A·sg(s)·exp(lp - sg(lp)) w.r.t. lp is -A·s per token
    torch.testing.assert_close(log_probs.grad[0, :2], torch.tensor([-s0, -s0]))


def test_gspo_packed_equals_padded():
    torch.manual_seed(0)
    log_probs, old = torch.randn(2, 4) * 0.1, torch.randn(2, 4) * 0.1
    advantages = torch.randn(2, 1).expand(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    padded, _ = gspo_policy_loss(log_probs, old, advantages, mask, clip_low=0.2, clip_high=0.3)
    keep = mask.bool()
    packed, _ = gspo_policy_loss(
        log_probs[keep],
        old[keep],
        advantages[keep],
        torch.ones(6),
        clip_low=0.2,
        clip_high=0.3,
        cu_seqlens=torch.tensor([0, 4, 6]),
    )
    torch.testing.assert_close(packed, padded[keep])


def test_cispo_by_hand():
    log_probs = torch.tensor([math.log(0.5), math.log(0.25)], requires_grad=True)
    old = torch.tensor([math.log(0.25), math.log(0.25)])  # ratios 2.0 and 1.0
    advantages = torch.tensor([1.0, 2.0])
    loss, clipfrac = cispo_loss(log_probs, old, advantages, clip_low=0.2, clip_high=0.5)
    expected = torch.tensor([-1.5 * 1.0 * math.log(0.5), -1.0 * 2.0 * math.log(0.25)])
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(clipfrac, torch.tensor([1.0, 0.0]))
    loss.sum().backward()  # the weight is a constant: gradient is -w·A
    torch.testing.assert_close(log_probs.grad, torch.tensor([-1.5, -2.0]))


def test_value_loss_by_hand():
    values = torch.tensor([1.0, 3.0])
    old_values = torch.tensor([0.0, 2.5])
    returns = torch.tensor([0.0, 2.0])
    plain, _ = value_loss(values, old_values, returns)
    torch.testing.assert_close(plain, torch.tensor([0.5, 0.5]))
    # clip 0.2: v0 clipped to 0.2 -> (0.2)^2 = 0.04 < 1 -> keeps 1; v1 clipped to 2.7 -> 0.49 < 1
    clipped, clipfrac = value_loss(values, old_values, returns, clip=0.2)
    torch.testing.assert_close(clipped, torch.tensor([0.5, 0.5]))
    assert clipfrac.sum() == 0
    # moving away from the return is where the clipped term wins
    clipped, clipfrac = value_loss(
        torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([3.0]), clip=0.5
    )
    torch.testing.assert_close(clipped, torch.tensor([0.5 * 9.0]))  # max(9, (0.5-3)^2=6.25)
    assert clipfrac.item() == 0.0
    clipped, clipfrac = value_loss(
        torch.tensor([5.0]), torch.tensor([4.0]), torch.tensor([3.0]), clip=0.5
    )
    torch.testing.assert_close(clipped, torch.tensor([0.5 * 4.0]))  # max(4, (4.5-3)^2=2.25)
    clipped, clipfrac = value_loss(
        torch.tensor([3.5]), torch.tensor([1.0]), torch.tensor([3.0]), clip=0.5
    )
    torch.testing.assert_close(clipped, torch.tensor([0.5 * 2.25]))  # (1.5-3)^2 > 0.25
    assert clipfrac.item() == 1.0


def test_sft_and_entropy_losses():
    torch.testing.assert_close(sft_loss(torch.tensor([-0.5, -2.0])), torch.tensor([0.5, 2.0]))
    torch.testing.assert_close(entropy_loss(torch.tensor([1.0])), torch.tensor([-1.0]))


def test_policy_loss_registry():
    assert {"ppo", "gspo", "cispo"} <= set(POLICY_LOSSES.names())
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'; choose one of: cispo"):
        POLICY_LOSSES.get("ppo2")
    with pytest.raises(ValueError, match="already registered"):
        POLICY_LOSSES.register("ppo")(lambda *a, **k: None)
    lp, old, adv = torch.randn(1, 3), torch.randn(1, 3), torch.randn(1, 3)
    common = dict(clip_low=0.2, clip_high=0.3, dual_clip=None, cu_seqlens=None)
    for name in POLICY_LOSSES:
        loss, clipfrac = POLICY_LOSSES.get(name)(lp, old, adv, torch.ones(1, 3), **common)
        assert loss.shape == (1, 3) and clipfrac.shape == (1, 3)
    ppo_loss, _ = POLICY_LOSSES.get("ppo")(lp, old, adv, None, **common)
    torch.testing.assert_close(
        ppo_loss, ppo_policy_loss(lp, old, adv, clip_low=0.2, clip_high=0.3)[0]
    )


def test_gspo_capped_sequence_passes_no_gradient():
    """A sequence whose mean log-ratio exceeds 10 has its ratio capped at e^10 and, as in
    verl, no gradient (uncapped, A < 0 would pass a gradient of e^10 per token)."""
    log_probs = torch.tensor([[11.0, 11.0], [0.1, 0.1]], requires_grad=True)
    advantages = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    loss, clipfrac = gspo_policy_loss(
        log_probs, torch.zeros(2, 2), advantages, torch.ones(2, 2), clip_low=0.2, clip_high=0.2
    )
    torch.testing.assert_close(loss[0], torch.full((2,), math.exp(10.0)))
    assert clipfrac.sum().item() == 0.0  # A < 0: the unclipped (larger) term is taken
    loss.sum().backward()
    torch.testing.assert_close(log_probs.grad[0], torch.zeros(2))
    torch.testing.assert_close(log_probs.grad[1], torch.full((2,), math.exp(0.1)))


def _float64(*shape, seed, scale=1.0, shift=0.0):
    generator = torch.Generator().manual_seed(seed)
    return scale * torch.randn(*shape, generator=generator, dtype=torch.float64) + shift


MASK_2x4 = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_float64_and_gradcheck(dual_clip):
    log_probs = _float64(2, 4, seed=0, scale=0.3, shift=-1.0).requires_grad_()
    old = _float64(2, 4, seed=1, scale=0.3, shift=-1.0).requires_grad_()
    advantages = _float64(2, 4, seed=2).requires_grad_()
    loss, clipfrac = ppo_policy_loss(
        log_probs, old, advantages, clip_high=0.28, dual_clip=dual_clip
    )
    assert loss.dtype == clipfrac.dtype == torch.float64
    assert 0 < clipfrac.sum() < clipfrac.numel()  # both branches are checked

    def fn(lp, o, a):
        return ppo_policy_loss(lp, o, a, clip_high=0.28, dual_clip=dual_clip)[0]

    assert torch.autograd.gradcheck(fn, (log_probs, old, advantages))


def test_gspo_float64_and_gradcheck_of_the_sequence_objective():
    """Aggregated per sequence, the token-level surrogate has exactly the gradient of the
    sequence-level objective -A·s_i: finite differences through s_i itself agree."""
    log_probs = _float64(2, 4, seed=3, scale=0.1, shift=-1.0).requires_grad_()
    old = _float64(2, 4, seed=4, scale=0.1, shift=-1.0)
    advantages = torch.tensor([[0.7] * 4, [-1.3] * 4], dtype=torch.float64, requires_grad=True)
    loss, clipfrac = gspo_policy_loss(
        log_probs, old, advantages, MASK_2x4, clip_low=0.2, clip_high=0.2
    )
    assert loss.dtype == clipfrac.dtype == torch.float64

    def sequence_objective(lp, a):
        per_token, _ = gspo_policy_loss(lp, old, a, MASK_2x4, clip_low=0.2, clip_high=0.2)
        return aggregate(per_token, MASK_2x4, mode="seq-mean-token-mean")

    assert torch.autograd.gradcheck(sequence_objective, (log_probs, advantages))


def test_cispo_float64_and_gradcheck():
    log_probs = _float64(2, 4, seed=5, scale=0.3, shift=-1.0).requires_grad_()
    # log-ratios of +-0.5 lie outside the clip range, where the clipped weight is a constant
    # and the stop-gradient surrogate's gradient is the true one
    old = log_probs.detach() + 0.5 * torch.tensor([[1, -1, 1, -1], [-1, 1, -1, 1]])
    advantages = _float64(2, 4, seed=6).requires_grad_()
    loss, clipfrac = cispo_loss(log_probs, old, advantages, clip_low=0.2, clip_high=0.3)
    assert loss.dtype == clipfrac.dtype == torch.float64
    assert clipfrac.eq(1).all()

    def fn(lp, a):
        return cispo_loss(lp, old, a, clip_low=0.2, clip_high=0.3)[0]

    assert torch.autograd.gradcheck(fn, (log_probs, advantages))
    # a float64 input beside float32 ones still gives float64
    mixed, _ = cispo_loss(log_probs.float(), old.float(), advantages, clip_low=0.2, clip_high=0.3)
    assert mixed.dtype == torch.float64


def test_value_sft_entropy_float64_and_gradcheck():
    values = _float64(2, 4, seed=7).requires_grad_()
    old_values = _float64(2, 4, seed=8).requires_grad_()
    returns = _float64(2, 4, seed=9).requires_grad_()
    loss, clipfrac = value_loss(values, old_values, returns, clip=0.5)
    assert loss.dtype == clipfrac.dtype == torch.float64
    assert 0 < clipfrac.sum() < clipfrac.numel()
    assert torch.autograd.gradcheck(
        lambda v, o, r: value_loss(v, o, r, clip=0.5)[0], (values, old_values, returns)
    )
    assert torch.autograd.gradcheck(lambda v, r: value_loss(v, v, r)[0], (values, returns))
    assert sft_loss(values).dtype == entropy_loss(values).dtype == torch.float64
    assert torch.autograd.gradcheck(sft_loss, (values,))
    assert torch.autograd.gradcheck(entropy_loss, (values,))
    half = torch.tensor([-1.0], dtype=torch.bfloat16)
    assert sft_loss(half).dtype == value_loss(half, half, half)[0].dtype == torch.float32


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
def test_registered_losses_keep_float64(name):
    log_probs, old = _float64(1, 3, seed=10), _float64(1, 3, seed=11)
    common = dict(clip_low=0.2, clip_high=0.3, dual_clip=None, cu_seqlens=None)
    loss, clipfrac = POLICY_LOSSES.get(name)(log_probs, old, old, torch.ones(1, 3), **common)
    assert loss.dtype == clipfrac.dtype == torch.float64
