"""Loss-side switches of slime's algorithm options, by hand: unbiased (importance-weighted)
KL, off-policy sequence masking (OPSM), and the Objective fields that carry them."""

import math

import pytest
import torch

from rl_core.importance import off_policy_sequence_mask
from rl_core.kl import approx_kl, importance_weighted_kl
from rl_core.objective import Objective, objective_loss, policy_objective
from rl_core.packing import cu_seqlens_from_lengths


def test_importance_weighted_kl_by_hand():
    # d = log pi - log pi_ref = 0.5; k3 = e^-0.5 - 1 + 0.5; ratio pi / pi_old = e^0.2
    log_probs, old, ref = torch.tensor([-1.0]), torch.tensor([-1.2]), torch.tensor([-1.5])
    k3 = math.exp(-0.5) - 1 + 0.5
    got = importance_weighted_kl(log_probs, old, ref, kind="k3")
    torch.testing.assert_close(got, torch.tensor([math.exp(0.2) * k3]))
    k1 = importance_weighted_kl(log_probs, old, ref, kind="k1")
    torch.testing.assert_close(k1, torch.tensor([math.exp(0.2) * 0.5]))


def test_importance_weighted_kl_is_the_plain_estimate_on_policy():
    log_probs, ref = -torch.rand(7), -torch.rand(7)
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        got = importance_weighted_kl(log_probs, log_probs, ref, kind=kind)
        torch.testing.assert_close(got, approx_kl(log_probs, ref, kind=kind))


def test_low_var_kl_clamps_the_weighted_product():
    # k3 of d = -3 is e^3 - 4 = 16.1 (clamped to 10 alone); times e^-3 it is 0.80, unclamped
    log_probs, old, ref = torch.tensor([-4.0]), torch.tensor([-1.0]), torch.tensor([-1.0])
    got = importance_weighted_kl(log_probs, old, ref, kind="low_var_kl")
    torch.testing.assert_close(got, torch.tensor([math.exp(-3.0) * (math.exp(3.0) - 4.0)]))
    big = importance_weighted_kl(torch.tensor([-1.0]), old - 3, ref + 3, kind="low_var_kl")
    assert float(big) == 10.0  # e^3 x 16.1 clamped after the product


def test_importance_weighted_kl_has_the_ratio_in_its_gradient():
    log_probs = torch.tensor([-1.0], requires_grad=True)
    old, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    importance_weighted_kl(log_probs, old, ref, kind="k1").sum().backward()
    # d/dx [e^(x - old) (x - ref)] at x = old: (x - ref) + 1 = 1.5
    assert float(log_probs.grad) == pytest.approx(1.5)


def test_opsm_masks_drifted_sequences_with_negative_advantage_padded():
    # rows: drifted & A<0 (dropped), drifted & A>0 (kept), not drifted & A<0 (kept)
    old = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0]])
    new = torch.tensor([[-1.5, -1.1, 0.0], [-1.5, -1.1, 0.0], [-1.0, -1.0, 0.0]])
    adv = torch.tensor([[-1.0, -1.0, 0.0], [1.0, 1.0, 0.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 3)
    keep, dropped = off_policy_sequence_mask(new, old, adv, mask, delta=0.2)
    # row 0 drift = (0.5 + 0.1) / 2 = 0.3 > 0.2
    torch.testing.assert_close(keep, torch.tensor([[0.0, 0.0, 1.0], [1.0] * 3, [1.0] * 3]))
    torch.testing.assert_close(dropped, torch.tensor([[1.0, 1.0, 0.0], [0.0] * 3, [0.0] * 3]))
    keep, _ = off_policy_sequence_mask(new, old, adv, mask, delta=0.3)  # not strictly above
    assert bool((keep == 1).all())


def test_opsm_packed_equals_padded():
    lengths = [3, 2, 4]
    cu = cu_seqlens_from_lengths(lengths)
    generator = torch.Generator().manual_seed(1)
    old, new = -torch.rand(9, generator=generator), -torch.rand(9, generator=generator)
    adv = torch.repeat_interleave(torch.tensor([-1.0, 2.0, -0.5]), torch.tensor(lengths))
    mask = torch.ones(9)
    keep, _ = off_policy_sequence_mask(new, old, adv, mask, delta=0.0, cu_seqlens=cu)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        row_keep, _ = off_policy_sequence_mask(
            new[start:end][None],
            old[start:end][None],
            adv[start:end][None],
            mask[None, : end - start],
            delta=0.0,
        )
        torch.testing.assert_close(keep[start:end], row_keep[0], msg=f"sequence {i}")


def _inputs():
    return {
        "log_probs": torch.tensor([-1.5, -1.1, -1.0, -1.0]),
        "old_log_probs": torch.tensor([-1.0, -1.0, -1.0, -1.0]),
        "advantages": torch.tensor([-1.0, -1.0, -1.0, -1.0]),
        "mask": torch.ones(4),
        "cu_seqlens": cu_seqlens_from_lengths([2, 2]),
        "num_tokens": 4.0,
        "num_seqs": 2.0,
    }


def test_opsm_in_the_policy_objective_drops_the_sequence_and_reports_it():
    plain, _ = policy_objective(**_inputs(), clip_low=10.0)
    masked, metrics = policy_objective(**_inputs(), clip_low=10.0, opsm_delta=0.2)
    # ppo loss per token = -A x ratio = ratio; sequence 0 (ratios e^-0.5, e^-0.1) dropped
    assert float(plain) == pytest.approx((math.exp(-0.5) + math.exp(-0.1) + 2) / 4)
    assert float(masked) == pytest.approx(2 / 4)
    assert metrics["pg/opsm_frac"] == pytest.approx(0.5)


def test_objective_carries_the_switches_to_the_loss():
    inputs = _inputs() | {"ref_log_probs": torch.tensor([-2.0, -2.0, -2.0, -2.0])}
    objective = Objective(kl_coef=1.0, kl_kind="k1", unbiased_kl=True, opsm=True, opsm_delta=0.2)
    _, metrics = objective_loss(objective, **inputs)
    ratios = [math.exp(-0.5), math.exp(-0.1), 1.0, 1.0]
    k1 = [0.5, 0.9, 1.0, 1.0]
    assert metrics["loss/kl"] == pytest.approx(
        sum(r * k for r, k in zip(ratios, k1, strict=True)) / 4
    )
    assert metrics["pg/opsm_frac"] == pytest.approx(0.5)
    _, plain = objective_loss(Objective(kl_coef=1.0, kl_kind="k1"), **inputs)
    assert plain["loss/kl"] == pytest.approx(sum(k1) / 4) and "pg/opsm_frac" not in plain


def test_objective_refuses_rollout_weights_with_rollout_old_log_probs():
    with pytest.raises(ValueError, match="rollout_is_level=None"):
        Objective(old_from_rollout=True, rollout_is_level="token")
    with pytest.raises(ValueError, match="opsm_delta must be >= 0"):
        Objective(opsm=True, opsm_delta=-1.0)


def _advantage_inputs(**overrides):
    from rl_core.advantages import AdvantageInputs

    fields = {
        "rewards": torch.tensor([1.0, 0.0, 0.0, 0.0]),
        "mask": torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]]),
        "values": torch.zeros(4, 2),
        "group_size": 4,
    }
    return AdvantageInputs(**(fields | overrides))


@pytest.mark.parametrize(
    "name, by_default",
    [
        ("grpo", False),
        ("dr_grpo", False),
        ("rloo", False),
        ("reinforce_plus_plus", True),
        ("reinforce_plus_plus_baseline", True),
        ("gae", True),
    ],
)
def test_whiten_overrides_each_estimators_default(name, by_default):
    from rl_core.advantages import ADVANTAGE_ESTIMATORS, whiten

    estimator = ADVANTAGE_ESTIMATORS.get(name)
    default, _ = estimator(_advantage_inputs())
    raw, returns = estimator(_advantage_inputs(whiten=False))
    white, white_returns = estimator(_advantage_inputs(whiten=True))
    mask = _advantage_inputs().mask
    torch.testing.assert_close(white, whiten(raw, mask))
    torch.testing.assert_close(default, white if by_default else raw)
    torch.testing.assert_close(white_returns, returns)  # returns are never whitened
    valid = white[mask > 0]
    assert float(valid.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(valid.std()) == pytest.approx(1.0, abs=1e-4)


def test_dr_grpo_advantages_by_hand_without_and_with_whitening():
    from rl_core.advantages import ADVANTAGE_ESTIMATORS

    # rewards 1, 0, 0, 0: centred 0.75, -0.25 x 3 on each valid token (7 tokens)
    raw, _ = ADVANTAGE_ESTIMATORS.get("dr_grpo")(_advantage_inputs(whiten=False))
    expected = torch.tensor([[0.75, 0.75], [-0.25, 0.0], [-0.25, -0.25], [-0.25, -0.25]])
    torch.testing.assert_close(raw, expected)
    white, _ = ADVANTAGE_ESTIMATORS.get("dr_grpo")(_advantage_inputs(whiten=True))
    mean = (2 * 0.75 - 5 * 0.25) / 7
    std = math.sqrt((2 * (0.75 - mean) ** 2 + 5 * (-0.25 - mean) ** 2) / 6)
    assert float(white[0, 0]) == pytest.approx((0.75 - mean) / std, rel=1e-5)


NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "lm_head.weight",
]


def test_train_only_then_freeze_by_regex_search():
    from rl_core.freezing import is_trained

    trained = [n for n in NAMES if is_trained(n, train_only=["mlp", "lm_head"], freeze=[r"1\."])]
    assert trained == ["model.layers.0.mlp.up_proj.weight", "lm_head.weight"]
    assert [is_trained(n) for n in NAMES] == [True] * 5  # no patterns: everything trains
    assert [n for n in NAMES if not is_trained(n, freeze=["embed"])] == NAMES[:1]


def test_patterns_that_match_nothing_or_everything_are_refused():
    from rl_core.freezing import check_patterns, unmatched_patterns

    assert unmatched_patterns(NAMES, ["mlp", "o_proj"]) == ["o_proj"]
    check_patterns(NAMES, train_only=["mlp"], freeze=["layers.1"])
    with pytest.raises(ValueError, match=r"model.freeze: \['o_proj'\] match no parameter"):
        check_patterns(NAMES, freeze=["o_proj"])
    with pytest.raises(ValueError, match=r"model\.train_only: '\(' is not a Python regular"):
        check_patterns(NAMES, train_only=["("])
    with pytest.raises(ValueError, match="leaves no parameter to train"):
        check_patterns(NAMES, train_only=["mlp"], freeze=["up_proj"])
