"""DPO as an Objective mode: packed pairs, global denominators, hand values."""

import math

import pytest
import torch

from rl_core.objective import Objective, objective_loss
from rl_core.preference import packed_pair_loss

# two pairs packed as four sequences: (chosen 0, rejected 0, chosen 1, rejected 1);
# lengths 3, 2, 3, 2; the first position of each is prompt (mask 0)
CU = torch.tensor([0, 3, 5, 8, 10], dtype=torch.int32)
MASK = torch.tensor([0, 1, 1, 0, 1, 0, 1, 1, 0, 1], dtype=torch.float32)
POLICY = torch.tensor([9.0, -1.0, -2.0, 9.0, -4.0, 9.0, -1.0, -1.0, 9.0, -1.0])
REF = torch.tensor([9.0, -1.5, -2.0, 9.0, -3.0, 9.0, -1.0, -2.0, 9.0, -1.0])


def test_sigmoid_loss_by_hand_with_the_step_wide_pair_count():
    # pair 0: policy chosen -3, rejected -4; ref -3.5, -3 -> margin (0.5) - (-1) = 1.5
    # pair 1: policy chosen -2, rejected -1; ref -3, -1 -> margin 1 - 0 = 1.0
    loss, metrics = packed_pair_loss(
        log_probs=POLICY, ref_log_probs=REF, mask=MASK, cu_seqlens=CU, num_pairs=4, beta=0.5
    )
    per_pair = [math.log1p(math.exp(-0.5 * 1.5)), math.log1p(math.exp(-0.5 * 1.0))]
    assert float(loss) == pytest.approx(sum(per_pair) / 4)  # two of the step's four pairs
    assert metrics["pref/accuracy"] == pytest.approx(2 / 4)  # both right, half the step
    assert metrics["pref/margin"] == pytest.approx((0.5 * 1.5 + 0.5 * 1.0) / 2 * 2 / 4)


def test_micro_batches_sum_to_the_whole_batch_and_gradients_agree():
    objective = Objective(mode="dpo", dpo_beta=0.2, dpo_loss="ipo")
    policy = POLICY.clone().requires_grad_()
    whole, _ = objective_loss(
        objective, log_probs=policy, mask=MASK, ref_log_probs=REF, cu_seqlens=CU, num_seqs=4
    )
    (whole_grad,) = torch.autograd.grad(whole, policy)
    parts = []
    for lo, hi, cu in ((0, 5, [0, 3, 5]), (5, 10, [0, 3, 5])):
        part, _ = objective_loss(
            objective,
            log_probs=policy[lo:hi],
            mask=MASK[lo:hi],
            ref_log_probs=REF[lo:hi],
            cu_seqlens=torch.tensor(cu),
            num_seqs=4,
        )
        parts.append(part)
    (split_grad,) = torch.autograd.grad(sum(parts), policy)
    torch.testing.assert_close(sum(parts), whole)
    torch.testing.assert_close(split_grad, whole_grad)
    assert float(whole) == pytest.approx(((1.5 - 2.5) ** 2 + (1.0 - 2.5) ** 2) / 2)
    assert float(whole_grad[0]) == 0.0 and float(whole_grad[1]) != 0.0  # prompt: no gradient


def test_an_empty_micro_batch_gives_zero_and_odd_sequences_are_refused():
    loss, metrics = packed_pair_loss(
        log_probs=torch.zeros(1, requires_grad=True),
        ref_log_probs=torch.zeros(1),
        mask=torch.zeros(1),
        cu_seqlens=torch.tensor([0, 1]),
        num_pairs=3,
    )
    assert float(loss) == 0.0 and loss.requires_grad and metrics["pref/accuracy"] == 0.0
    with pytest.raises(ValueError, match="3 sequences do not make pairs"):
        packed_pair_loss(
            log_probs=POLICY[:8],
            ref_log_probs=REF[:8],
            mask=MASK[:8],
            cu_seqlens=CU[:4],
            num_pairs=2,
        )


def test_objective_dpo_needs_the_reference_and_checks_its_fields():
    assert Objective(mode="dpo").needs_reference and not Objective().needs_reference
    with pytest.raises(ValueError, match="dpo_beta must be > 0"):
        Objective(mode="dpo", dpo_beta=0.0)
    with pytest.raises(ValueError, match=r"dpo_label_smoothing must be < 0\.5"):
        Objective(mode="dpo", dpo_label_smoothing=0.5)
    with pytest.raises(ValueError, match="dpo_loss='hinge' unknown"):
        Objective(mode="dpo", dpo_loss="hinge")
