"""FSDPBackend as rl_core's TrainingBackend: its signatures match the protocol, ``start``
joins the group, and the config's Objective is the loss a step computes, term by term (the
same number policy_objective gives with those terms spelled out, as the backend computed
it before the Objective existed)."""

import pytest
import torch
import torch.distributed as dist
from fsdp_tiny import CONFIGS, tokens_batch

from rl_core.distributed import free_port
from rl_core.objective import Objective, policy_objective
from rl_core.protocols import TrainingBackend, protocol_mismatches
from rl_fsdp import FSDPBackend, FSDPConfig

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
        policy_loss="fsdp_user_loss:ratio_pg_loss",
        loss_agg_mode="fsdp_user_loss:token_sum_over_global",
    ),
}


@pytest.fixture(scope="module")
def group():
    """The process group the backends' ``start`` joins (once) and reuses."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def start(objective: Objective) -> FSDPBackend:
    config = FSDPConfig(model_config=CONFIGS["qwen2"], device="cpu", lr=1e-2, objective=objective)
    return FSDPBackend.start(
        config, rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()
    )


def rl_batch(log_probs: torch.Tensor):
    batch = tokens_batch()
    gen = torch.Generator().manual_seed(4)
    batch.advantages = torch.randn(batch.num_tokens, generator=gen)
    batch.old_log_probs = log_probs + 0.5 * torch.randn(batch.num_tokens, generator=gen)
    batch.ref_log_probs = log_probs + 0.1 * torch.randn(batch.num_tokens, generator=gen)
    return batch.with_global_denominators()


def test_signatures_match_the_protocol():
    assert protocol_mismatches(FSDPBackend, TrainingBackend) == []


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_a_step_computes_the_objective_of_the_config(group, name):
    objective = OBJECTIVES[name]
    backend = start(objective)
    assert isinstance(backend, TrainingBackend)
    assert (backend.data_rank, backend.step) == (0, 0)
    assert (backend.ref_model is not None) == objective.needs_reference
    log_probs = backend.compute_log_probs(tokens_batch())
    batch = rl_batch(log_probs)
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


def test_temperature_and_mode_are_read(group):
    batch = tokens_batch()
    hot = start(Objective(temperature=0.7)).compute_log_probs(batch)
    plain = start(Objective()).compute_log_probs(batch)
    assert not torch.allclose(hot, plain)
    sft = start(Objective(mode="sft")).train_step(batch.with_global_denominators())
    nll = -(plain * batch.loss_mask).sum() / batch.loss_mask.sum()
    assert sft["loss/sft"] == pytest.approx(float(nll), rel=1e-5)


def test_reference_from_ref_path_then_refreshed_from_the_policy(group, tmp_path):
    """``ref_path`` loads another model as the reference; ``update_reference`` makes it
    the policy as trained so far (rl-train's algorithm.ref_path / ref_update_interval), and a
    checkpoint keeps a refreshed reference (only that one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(7)
    hf_config = AutoConfig.for_model(**CONFIGS["qwen2"])
    AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path / "other")
    batch = tokens_batch()
    other = FSDPBackend.start(
        FSDPConfig(model_path=str(tmp_path / "other"), device="cpu"),
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=free_port(),
    ).compute_log_probs(batch)
    config = FSDPConfig(
        model_config=CONFIGS["qwen2"],
        device="cpu",
        lr=1e-2,
        objective=Objective(kl_coef=0.1),
        ref_path=str(tmp_path / "other"),
    )
    backend = FSDPBackend.start(
        config, rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()
    )
    torch.testing.assert_close(backend.compute_log_probs(batch, model="ref"), other)
    policy = backend.compute_log_probs(batch)
    assert not torch.allclose(policy, other, atol=1e-3)
    backend.train_step(rl_batch(policy))
    trained = backend.compute_log_probs(batch)
    assert not torch.allclose(trained, policy, atol=1e-4)  # the step changed the policy
    backend.save_checkpoint(tmp_path / "before")  # the starting reference: not saved
    backend.update_reference()
    torch.testing.assert_close(backend.compute_log_probs(batch, model="ref"), trained)
    backend.save_checkpoint(tmp_path / "after")  # the refreshed one: saved with the weights
    assert not (tmp_path / "before/reference").exists()
    resumed = FSDPBackend.start(
        config, rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()
    )
    torch.testing.assert_close(resumed.compute_log_probs(batch, model="ref"), other)
    resumed.load_checkpoint(tmp_path / "after")
    got = resumed.compute_log_probs(batch, model="ref")
    torch.testing.assert_close(got, trained, atol=0, rtol=0)
    with pytest.raises(ValueError, match="needs a separate reference"):
        start(Objective()).update_reference()


def test_only_the_parameters_the_patterns_train_change(group):
    """``train_only`` / ``freeze`` (rl-train's model.train_only / model.freeze): the
    optimizer holds only the trained parameters, and a step changes only them."""
    config = FSDPConfig(
        model_config=CONFIGS["qwen2"],
        device="cpu",
        lr=1e-2,
        train_only=("mlp", "norm"),
        freeze=(r"layers\.1\.",),
    )
    backend = FSDPBackend.start(
        config, rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()
    )
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    backend.train_step(rl_batch(backend.compute_log_probs(tokens_batch())))
    trained = {"mlp", "norm"}
    changed = {n for n, p in backend.model.named_parameters() if not torch.equal(p, before[n])}
    expected = {n for n in before if any(t in n for t in trained) and "layers.1." not in n}
    assert changed == expected and "model.layers.0.mlp.up_proj.weight" in changed
    held = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    params = dict(backend.model.named_parameters())
    assert held == {id(params[n]) for n in expected}
    with pytest.raises(ValueError, match=r"FSDPConfig.freeze: \['o_porj'\] match no"):
        FSDPBackend(
            FSDPConfig(model_config=CONFIGS["qwen2"], device="cpu", freeze=("o_porj",)),
        )
