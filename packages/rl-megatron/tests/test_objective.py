"""MegatronBackend as rl_core's TrainingBackend: its signatures match the protocol, ``start``
joins the group (CPU shim included), and the config's Objective is the loss a step
computes, term by term (the number policy_objective gives with those terms spelled out,
as the backend computed it before the Objective existed)."""

import pytest
import tiny
import torch

from rl_core.distributed import free_port
from rl_core.objective import Objective, policy_objective
from rl_core.protocols import TrainingBackend, protocol_mismatches
from rl_megatron.backend import MegatronBackend
from rl_megatron.config import MegatronConfig

LENGTHS = [9, 14, 6, 11]
OBJECTIVES = {
    "gspo, seq-mean-token-mean": Objective(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean"),
    "cispo, clip-higher, Dr.GRPO norm": Objective(
        policy_loss="cispo",
        clip_high=0.28,
        loss_agg_mode="seq-mean-token-sum-norm",
        norm_length=32.0,
    ),
    "ppo, dual clip, k3 KL, temperature": Objective(
        dual_clip=1.2, kl_coef=0.1, kl_kind="k3", temperature=0.7
    ),
    "unbiased k3 KL, OPSM, old log-probs from the rollout": Objective(
        kl_coef=0.1,
        kl_kind="k3",
        unbiased_kl=True,
        opsm=True,
        opsm_delta=0.0,
        old_from_rollout=True,
    ),
    "a user loss and reducer by dotted path": Objective(
        policy_loss="megatron_user_loss:ratio_pg_loss",
        loss_agg_mode="megatron_user_loss:token_sum_over_global",
    ),
}


def start(model_dirs, objective: Objective) -> MegatronBackend:
    config = MegatronConfig(
        hf_path=model_dirs["qwen3"][0], device="cpu", lr=1e-3, clip_grad=0.0, objective=objective
    )
    return MegatronBackend.start(
        config, rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()
    )


def test_signatures_match_the_protocol():
    assert protocol_mismatches(MegatronBackend, TrainingBackend) == []


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_a_step_computes_the_objective_of_the_config(world1, model_dirs, name):
    objective = OBJECTIVES[name]
    backend = start(model_dirs, objective)
    assert isinstance(backend, TrainingBackend)
    assert (backend.data_rank, backend.step) == (0, 0)
    assert (backend.ref_shards is not None) == objective.needs_reference
    batch = tiny.random_batch(LENGTHS, seed=9)
    log_probs = backend.compute_log_probs(batch)
    gen = torch.Generator().manual_seed(4)
    batch.old_log_probs = log_probs + 0.5 * torch.randn(batch.num_tokens, generator=gen)
    batch.ref_log_probs = log_probs + 0.1 * torch.randn(batch.num_tokens, generator=gen)
    if objective.old_from_rollout:  # the loop's batch then: old log-probs are the engine's
        batch.rollout_log_probs = batch.old_log_probs
    metrics = backend.train_step(batch)
    expected, _ = policy_objective(
        log_probs=log_probs,
        old_log_probs=batch.old_log_probs,
        advantages=batch.advantages,
        mask=batch.loss_mask,
        loss_name=objective.policy_loss,
        clip_low=objective.clip_low,
        clip_high=objective.clip_high,
        dual_clip=objective.dual_clip,
        ref_log_probs=batch.ref_log_probs,
        kl_coef=objective.kl_coef,
        kl_kind=objective.kl_kind,
        unbiased_kl=objective.unbiased_kl,
        opsm_delta=objective.opsm_delta if objective.opsm else None,
        agg_mode=objective.loss_agg_mode,
        norm_length=objective.norm_length,
        cu_seqlens=batch.cu_seqlens,
        num_tokens=batch.global_num_tokens,
        num_seqs=batch.global_num_seqs,
    )
    assert metrics["loss/total"] == pytest.approx(float(expected), rel=1e-5, abs=1e-6)
    assert ("loss/kl" in metrics) == (objective.kl_coef > 0)
    assert ("pg/opsm_frac" in metrics) == objective.opsm
    if objective.old_from_rollout:  # no recompute: the step reports its own gap to them
        gap = (log_probs - batch.rollout_log_probs).abs()[batch.loss_mask > 0].mean()
        assert metrics["mismatch/logprob_abs_diff_mean"] == pytest.approx(float(gap), rel=1e-5)
        assert 0 < metrics["pg/opsm_frac"] < 1
    else:
        assert "mismatch/logprob_abs_diff_mean" not in metrics
    assert {"train/grad_norm", "train/lr", "train/nonfinite_skipped"} <= set(metrics)
    assert backend.step == 1


def test_temperature_and_mode_are_read(world1, model_dirs):
    batch = tiny.random_batch(LENGTHS, seed=9)
    hot = start(model_dirs, Objective(temperature=0.7)).compute_log_probs(batch)
    plain = start(model_dirs, Objective()).compute_log_probs(batch)
    assert not torch.allclose(hot, plain)
    sft = start(model_dirs, Objective(mode="sft")).train_step(batch)
    nll = -(plain * batch.loss_mask).sum() / batch.loss_mask.sum()
    assert sft["loss/sft"] == pytest.approx(float(nll), rel=1e-5)
