import pytest
import torch

from rl_core.aggregation import AGGREGATION_MODES, aggregate
from rl_core.importance import rollout_importance_weights
from rl_core.kl import approx_kl
from rl_core.losses import ppo_policy_loss
from rl_core.objective import policy_objective, sft_objective
from rl_core.packing import cu_seqlens_from_lengths, first_fit_pack


def random_packed(num_seqs=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (num_seqs,), generator=generator).tolist()
    n = sum(lengths)
    return {
        "lengths": lengths,
        "cu_seqlens": cu_seqlens_from_lengths(lengths),
        "log_probs": -torch.rand(n, generator=generator),
        "old_log_probs": -torch.rand(n, generator=generator),
        "ref_log_probs": -torch.rand(n, generator=generator),
        "advantages": torch.randn(n, generator=generator),
        "entropy": torch.rand(n, generator=generator),
        "mask": (torch.rand(n, generator=generator) > 0.25).float(),
    }


def test_composition_by_parts():
    data = random_packed()
    log_probs = data["log_probs"].clone().requires_grad_()
    loss, metrics = policy_objective(
        log_probs=log_probs,
        old_log_probs=data["old_log_probs"],
        advantages=data["advantages"],
        mask=data["mask"],
        entropy=data["entropy"],
        entropy_coef=0.01,
        ref_log_probs=data["ref_log_probs"],
        kl_coef=0.1,
        kl_kind="k3",
    )
    pg, _ = ppo_policy_loss(log_probs, data["old_log_probs"], data["advantages"])
    kl = approx_kl(log_probs, data["ref_log_probs"], kind="k3")
    expected = (
        aggregate(pg, data["mask"])
        + 0.1 * aggregate(kl, data["mask"])
        - 0.01 * aggregate(data["entropy"], data["mask"])
    )
    torch.testing.assert_close(loss, expected)
    assert metrics["loss/total"] == pytest.approx(float(expected))
    assert set(metrics) >= {"loss/pg", "pg/clipfrac", "loss/kl", "actor/entropy"}


@pytest.mark.parametrize("loss_name", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize("agg_mode", AGGREGATION_MODES)
def test_micro_batches_sum_to_full_batch(loss_name, agg_mode):
    data = random_packed(num_seqs=8, seed=3)
    cu = data["cu_seqlens"]
    weights, _ = rollout_importance_weights(
        data["old_log_probs"], data["log_probs"] - 0.05, data["mask"], cu_seqlens=cu
    )

    def objective(index, num_tokens, num_seqs, log_probs):
        sub_cu = cu_seqlens_from_lengths([data["lengths"][i] for i in index])
        token_index = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in index])
        loss, metrics = policy_objective(
            log_probs=log_probs[token_index],
            old_log_probs=data["old_log_probs"][token_index],
            advantages=data["advantages"][token_index],
            mask=data["mask"][token_index],
            loss_name=loss_name,
            clip_high=0.28,
            entropy=data["entropy"][token_index],
            ref_log_probs=data["ref_log_probs"][token_index],
            kl_coef=0.05,
            importance_weights=weights[token_index],
            agg_mode=agg_mode,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            cu_seqlens=sub_cu,
            norm_length=10.0,  # the horizon, shared by every part (used by the -norm mode)
        )
        return loss, metrics

    log_probs = data["log_probs"].clone().requires_grad_()
    everything = list(range(8))
    full, full_metrics = objective(everything, None, None, log_probs)
    (full_grad,) = torch.autograd.grad(full, log_probs)

    num_tokens = float(data["mask"].sum())
    per_seq_valid = torch.zeros(8).index_add(
        0, torch.repeat_interleave(torch.arange(8), torch.tensor(data["lengths"])), data["mask"]
    )
    num_seqs = float((per_seq_valid > 0).sum())
    micro_batches = first_fit_pack(data["lengths"], max_tokens=12)
    assert len(micro_batches) > 1
    total, metric_sums = 0.0, {}
    for index in micro_batches:
        part, metrics = objective(index, num_tokens, num_seqs, log_probs)
        total = total + part
        for key, value in metrics.items():
            metric_sums[key] = metric_sums.get(key, 0.0) + value
    (part_grad,) = torch.autograd.grad(total, log_probs)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(part_grad, full_grad)
    for key, value in full_metrics.items():
        assert metric_sums[key] == pytest.approx(value, abs=1e-5), key


def test_sft_objective():
    log_probs = torch.tensor([-1.0, -2.0, -3.0])
    loss, metrics = sft_objective(log_probs=log_probs, mask=torch.tensor([1.0, 1.0, 0.0]))
    assert loss.item() == pytest.approx(1.5)
    assert metrics["loss/sft"] == pytest.approx(1.5)
    packed = dict(log_probs=log_probs, mask=torch.ones(3), cu_seqlens=torch.tensor([0, 1, 3]))
    loss, _ = sft_objective(**packed, agg_mode="seq-mean-token-sum-norm", norm_length=4.0)
    assert loss.item() == pytest.approx(6.0 / 4)


@pytest.mark.parametrize("agg_mode", AGGREGATION_MODES)
def test_clipfrac_is_the_fraction_of_valid_tokens_in_every_mode(agg_mode):
    # ratios 1.5 (clipped, A > 0), 1.0, 1.0 | 0.5 (clipped, A > 0), masked 3.0
    log_probs = torch.tensor([[1.5, 1.0, 1.0], [0.5, 3.0, 1.0]]).log()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    _, metrics = policy_objective(
        log_probs=log_probs,
        old_log_probs=torch.zeros(2, 3),
        advantages=torch.tensor([[1.0] * 3, [-1.0] * 3]),
        mask=mask,
        agg_mode=agg_mode,
    )
    assert metrics["pg/clipfrac"] == pytest.approx(2 / 4)
    _, metrics = policy_objective(
        log_probs=log_probs,
        old_log_probs=torch.zeros(2, 3),
        advantages=torch.ones(2, 3),
        mask=mask,
        agg_mode=agg_mode,
        num_tokens=8.0,
    )
    assert metrics["pg/clipfrac"] == pytest.approx(1 / 8)  # this part's share of the step


def test_unknown_loss_name():
    data = random_packed()
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'"):
        policy_objective(
            log_probs=data["log_probs"],
            old_log_probs=data["old_log_probs"],
            advantages=data["advantages"],
            mask=data["mask"],
            loss_name="grpo",
        )


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_tensor_metrics_equal_the_float_metrics_and_need_no_read_back(agg_mode):
    """tensor_metrics=True returns the same numbers as 0-d tensors; on the 'meta' device
    (where any read-back raises) the whole objective then runs, seq-mean modes included."""
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 5, 4]
    cu = cu_seqlens_from_lengths(lengths)
    n = sum(lengths)
    inputs = {
        "log_probs": torch.randn(n, generator=gen) - 1,
        "old_log_probs": torch.randn(n, generator=gen) - 1,
        "advantages": torch.randn(n, generator=gen),
        "mask": (torch.rand(n, generator=gen) > 0.2).float(),
        "entropy": torch.rand(n, generator=gen),
        "ref_log_probs": torch.randn(n, generator=gen) - 1,
    }
    common = {
        "kl_coef": 0.1,
        "entropy_coef": 0.01,
        "agg_mode": agg_mode,
        "cu_seqlens": cu,
        "num_tokens": 9.0,
        "num_seqs": 3.0,
    }
    _, floats = policy_objective(**inputs, **common)
    _, tensors = policy_objective(**inputs, **common, tensor_metrics=True)
    assert set(floats) == set(tensors)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in tensors.values())
    assert {k: float(v) for k, v in tensors.items()} == floats
    on_meta = {k: v.to("meta") for k, v in inputs.items()}
    loss, metrics = policy_objective(
        **on_meta, **common | {"cu_seqlens": cu.to("meta")}, tensor_metrics=True
    )
    assert loss.device.type == "meta" and all(v.device.type == "meta" for v in metrics.values())
    with pytest.raises(RuntimeError, match="meta"):  # the float path does read back
        policy_objective(**on_meta, **common | {"cu_seqlens": cu.to("meta")})


def test_sft_and_importance_tensor_metrics():
    log_probs, mask = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([1.0, 1.0, 0.0])
    _, floats = sft_objective(log_probs=log_probs, mask=mask)
    _, tensors = sft_objective(log_probs=log_probs, mask=mask, tensor_metrics=True)
    assert (
        {k: float(v) for k, v in tensors.items()} == floats == {"loss/sft": 1.5, "loss/total": 1.5}
    )
    old, rollout = torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-1.5, -1.0, -0.2])
    _, floats = rollout_importance_weights(old, rollout, mask)
    _, tensors = rollout_importance_weights(old, rollout, mask, tensor_metrics=True)
    assert {k: float(v) for k, v in tensors.items()} == floats
