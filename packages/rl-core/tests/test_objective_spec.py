"""The Objective spec: validated once, read by objective_loss term by term."""

import dataclasses

import pytest
import torch

from rl_core.aggregation import aggregate
from rl_core.batch import TrainBatch
from rl_core.importance import rollout_importance_weights
from rl_core.kl import approx_kl
from rl_core.losses import ppo_policy_loss
from rl_core.objective import (
    Objective,
    batch_objective_loss,
    objective_loss,
    policy_inputs,
    policy_objective,
)
from rl_core.packing import cu_seqlens_from_lengths

LOG_PROBS = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]])
OLD = torch.tensor([[-1.2, -0.5, -1.0], [-0.3, -2.0, -0.7]])
REF = torch.tensor([[-0.9, -0.6, -1.5], [-0.4, -1.0, -0.9]])
ADVANTAGES = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
ENTROPY = torch.tensor([[0.5, 0.25, 1.0], [2.0, 0.5, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mode": "kto"}, "mode='kto' unknown; choose one of: policy, sft, dpo"),
        ({"policy_loss": "grpo"}, "policy_loss='grpo' unknown; choose one of: cispo, gspo"),
        ({"loss_agg_mode": "mean"}, "loss_agg_mode='mean' unknown; choose one of: token-mean"),
        ({"kl_kind": "k4"}, "kl_kind='k4' unknown; choose one of: k1, k2, k3, low_var_kl"),
        ({"rollout_is_level": "batch"}, "rollout_is_level='batch' unknown; choose one of: None"),
        ({"rollout_is_mode": "clip"}, "rollout_is_mode='clip' unknown"),
        ({"clip_low": -0.1}, "clip_low must be >= 0"),
        ({"clip_high": -0.1}, "clip_high must be >= 0"),
        ({"kl_coef": -1.0}, "kl_coef must be >= 0"),
        ({"entropy_coef": float("nan")}, "entropy_coef must be a finite number"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"rollout_is_cap": 0.0}, "rollout_is_cap must be > 0"),
        ({"norm_length": -4.0}, "norm_length must be > 0"),
        ({"dual_clip": 1.0}, "dual_clip must be > 1"),
        ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "needs norm_length"),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Objective(**fields)


def test_defaults_are_valid_frozen_and_keyword_only():
    objective = Objective()
    assert (objective.mode, objective.policy_loss, objective.loss_agg_mode) == (
        "policy",
        "ppo",
        "token-mean",
    )
    assert not objective.needs_reference and not objective.corrects_rollout
    with pytest.raises(dataclasses.FrozenInstanceError):
        objective.kl_coef = 0.1  # type: ignore[misc]
    with pytest.raises(TypeError):
        Objective("policy")  # type: ignore[misc]
    assert Objective(dual_clip=3.0, norm_length=8.0).dual_clip == 3.0


def test_reference_and_rollout_correction_follow_the_terms():
    assert Objective(kl_coef=0.1).needs_reference
    assert Objective(reward_kl_coef=0.1).needs_reference  # the reward's KL needs it too
    assert Objective(rollout_is_level="sequence").corrects_rollout


def test_objective_loss_is_policy_objective_with_every_term():
    """KL, entropy, clip-higher and importance weights all reach the loss, by hand."""
    weights, _ = rollout_importance_weights(OLD, LOG_PROBS - 0.3, MASK, cap=1.2)
    objective = Objective(clip_high=0.28, kl_coef=0.1, kl_kind="k3", entropy_coef=0.01)
    log_probs = LOG_PROBS.clone().requires_grad_()
    loss, metrics = objective_loss(
        objective,
        log_probs=log_probs,
        mask=MASK,
        old_log_probs=OLD,
        advantages=ADVANTAGES,
        entropy=ENTROPY,
        ref_log_probs=REF,
        importance_weights=weights,
    )
    pg, _ = ppo_policy_loss(log_probs, OLD, ADVANTAGES, clip_low=0.2, clip_high=0.28)
    kl = approx_kl(log_probs, REF, kind="k3")
    expected = (
        aggregate(pg * weights, MASK) + 0.1 * aggregate(kl, MASK) - 0.01 * aggregate(ENTROPY, MASK)
    )
    torch.testing.assert_close(loss, expected)
    assert set(metrics) == {"loss/pg", "pg/clipfrac", "loss/kl", "actor/entropy", "loss/total"}
    no_clip_high, _ = objective_loss(
        dataclasses.replace(objective, clip_high=None),
        log_probs=log_probs,
        mask=MASK,
        old_log_probs=OLD,
        advantages=ADVANTAGES,
        entropy=ENTROPY,
        ref_log_probs=REF,
        importance_weights=weights,
    )
    assert float(no_clip_high.detach()) != pytest.approx(float(loss.detach()))  # clip_high read


@pytest.mark.parametrize("loss_agg_mode", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_objective_loss_aggregates_as_the_objective_says(loss_agg_mode):
    objective = Objective(policy_loss="cispo", loss_agg_mode=loss_agg_mode, norm_length=4.0)
    loss, _ = objective_loss(
        objective, log_probs=LOG_PROBS, mask=MASK, old_log_probs=OLD, advantages=ADVANTAGES
    )
    expected, _ = policy_objective(
        log_probs=LOG_PROBS,
        old_log_probs=OLD,
        advantages=ADVANTAGES,
        mask=MASK,
        loss_name="cispo",
        agg_mode=loss_agg_mode,
        norm_length=4.0,
    )
    torch.testing.assert_close(loss, expected)


def test_sft_mode_is_the_mean_negative_log_likelihood():
    objective = Objective(mode="sft", loss_agg_mode="seq-mean-token-sum-norm", norm_length=2.0)
    loss, metrics = objective_loss(objective, log_probs=LOG_PROBS, mask=MASK)
    assert float(loss) == pytest.approx((3.5 + 1.5) / 2.0)  # summed rows / norm_length
    assert metrics == {"loss/sft": pytest.approx(2.5), "loss/total": pytest.approx(2.5)}
    with pytest.raises(ValueError, match="needs old_log_probs and advantages"):
        objective_loss(Objective(), log_probs=LOG_PROBS, mask=MASK)


def packed(old=None, rollout=None, num_tokens=10.0) -> TrainBatch:
    """Two sequences of 3 and 2 tokens, one micro-batch of a step of ``num_tokens`` tokens."""
    batch = TrainBatch(
        tokens=torch.zeros(5, dtype=torch.long),
        cu_seqlens=cu_seqlens_from_lengths([3, 2]),
        loss_mask=torch.ones(5),
        advantages=torch.ones(5),
        old_log_probs=old,
        rollout_log_probs=rollout,
    )
    batch.global_num_tokens, batch.global_num_seqs = num_tokens, 4.0
    return batch


def test_policy_inputs_take_the_old_log_probs_and_scale_metrics_by_the_share():
    log_probs = torch.tensor([-1.0, -0.5, -2.0, -0.3, -1.2])
    old = torch.tensor([-1.1, -0.5, -1.0, -0.3, -2.0])
    rollout = torch.tensor([-1.0, -0.7, -1.0, -0.5, -2.0])
    objective = Objective(rollout_is_level="token", rollout_is_mode="truncate", rollout_is_cap=2.0)
    got_old, weights, metrics = policy_inputs(objective, packed(old, rollout), log_probs)
    assert torch.equal(got_old, old)
    expected, full = rollout_importance_weights(
        old, rollout, torch.ones(5), level="token", mode="truncate", cap=2.0
    )
    assert torch.allclose(weights, expected)
    assert metrics == pytest.approx({key: value * 0.5 for key, value in full.items()})  # 5 of 10
    assert "mismatch/logprob_abs_diff_mean" not in metrics  # the recompute measured it


def test_on_policy_inputs_report_this_forwards_gap_to_the_engine():
    log_probs = torch.tensor([-1.0, -0.5, -2.0, -0.3, -1.2])
    rollout = log_probs + torch.tensor([0.1, -0.1, 0.0, 0.2, 0.0])
    old, weights, metrics = policy_inputs(Objective(), packed(rollout=rollout), log_probs)
    assert torch.equal(old, log_probs) and weights is None
    assert metrics["mismatch/logprob_abs_diff_mean"] == pytest.approx(0.4 / 10)
    tensors = policy_inputs(Objective(), packed(rollout=rollout), log_probs, tensor_metrics=True)
    assert isinstance(tensors[2]["mismatch/logprob_abs_diff_mean"], torch.Tensor)


def test_policy_inputs_refuse_a_batch_they_cannot_correct():
    with pytest.raises(ValueError, match="has no rollout_log_probs"):
        policy_inputs(Objective(rollout_is_level="token"), packed(), torch.zeros(5))
    batch = packed()
    batch.advantages = None
    with pytest.raises(ValueError, match=r"needs batch\.advantages"):
        policy_inputs(Objective(), batch, torch.zeros(5))


def test_a_batch_loss_is_the_objective_loss_of_the_batch_and_its_policy_inputs():
    """What both backends call per micro-batch: the old log-probs, the importance weights
    and their metrics of policy_inputs, the batch's tensors and global denominators."""
    log_probs = torch.tensor([-1.0, -0.5, -2.0, -0.3, -1.2])
    old = torch.tensor([-1.1, -0.5, -1.0, -0.3, -2.0])
    rollout = torch.tensor([-1.0, -0.7, -1.0, -0.5, -2.0])
    entropy = torch.tensor([0.5, 0.25, 1.0, 2.0, 0.5])
    objective = Objective(entropy_coef=0.1, rollout_is_level="token", rollout_is_cap=2.0)
    batch = packed(old, rollout)
    loss, metrics = batch_objective_loss(objective, batch, log_probs, entropy)
    _, weights, is_metrics = policy_inputs(objective, batch, log_probs)
    expected, loss_metrics = objective_loss(
        objective,
        log_probs=log_probs,
        mask=batch.loss_mask,
        old_log_probs=old,
        advantages=batch.advantages,
        entropy=entropy,
        importance_weights=weights,
        num_tokens=10.0,
        num_seqs=4.0,
        cu_seqlens=batch.cu_seqlens,
    )
    assert torch.equal(loss, expected) and is_metrics
    assert metrics == is_metrics | loss_metrics
    sft, sft_metrics = batch_objective_loss(Objective(mode="sft"), batch, log_probs)
    assert float(sft) == pytest.approx(float(-log_probs.sum()) / 10)  # no advantages used
    assert set(sft_metrics) == {"loss/sft", "loss/total"}
