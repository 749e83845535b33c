"""Two real gloo ranks (torch.multiprocessing, 127.0.0.1) against the single-process,
unsharded, padded reference: log-probs, loss and gradients (1 and many micro-batches),
SFT, weight-export buckets, HF export, checkpoint resume and the critic.

The ranks run once per session (tests/fsdp_dist_worker.py); each test checks one invariant.
"""

import itertools
import math

import fsdp_dist_worker
import pytest
import torch
import torch.multiprocessing as mp
from fsdp_tiny import CONFIGS, padded_log_probs, padded_logits, plain_model, tokens_batch

from rl_core.distributed import free_port
from rl_core.importance import rollout_importance_weights
from rl_core.objective import Objective, policy_objective, sft_objective
from rl_fsdp.optim import lr_multiplier

pytestmark = pytest.mark.integration
WORLD_SIZE = 2
SMALL_BUDGET, LARGE_BUDGET = 20, 10_000
ACTOR = {
    "model_config": CONFIGS["qwen2"],
    "device": "cpu",
    "reference": True,
    "lr": 1e-2,
    "objective": Objective(kl_coef=0.1, entropy_coef=0.01, rollout_is_level="token"),
    "warmup_steps": 2,
    "lr_decay": "cosine",
    "total_steps": 6,
    "max_grad_norm": 1.0,
    "logits_chunk_size": 32,
    "activation_checkpointing": True,
}
CRITIC = {"model_config": CONFIGS["qwen2"], "device": "cpu", "lr": 1e-3, "seed": 1}


def _rl_batch():
    """The global batch: old/ref/rollout log-probs near the initial policy's."""
    gen = torch.Generator().manual_seed(1)
    batch = tokens_batch()
    with torch.no_grad():
        lp = padded_log_probs(plain_model(CONFIGS["qwen2"]), batch)
    n = batch.num_tokens
    batch.advantages = torch.randn(n, generator=gen)
    batch.old_log_probs = lp + 0.05 * torch.randn(n, generator=gen)
    batch.ref_log_probs = lp + 0.05 * torch.randn(n, generator=gen)
    batch.rollout_log_probs = batch.old_log_probs + 0.5 * torch.randn(n, generator=gen)
    batch.returns = torch.randn(n, generator=gen)
    return batch.with_global_denominators()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fsdp2")
    batch = _rl_batch()
    spec = {
        "batch": batch,
        "actor": ACTOR,
        "critic": CRITIC,
        "budgets": [SMALL_BUDGET, LARGE_BUDGET],
        "bucket_bytes": 40_000,
        "steps": 2,
    }
    torch.save(spec, workdir / "spec.pt")
    mp.spawn(fsdp_dist_worker.run, args=(WORLD_SIZE, free_port(), str(workdir)), nprocs=WORLD_SIZE)
    return batch, torch.load(workdir / "results.pt", weights_only=False), workdir


def _per_seq(batch, values):
    bounds = batch.cu_seqlens.tolist()
    return torch.cat(
        [values[tuple(batch.tokens[a:b].tolist())] for a, b in itertools.pairwise(bounds)]
    )


def _reference_rl(batch):
    """Loss, metrics and gradients of the whole batch in one process, padded forward."""
    model = plain_model(CONFIGS["qwen2"])
    logits = padded_logits(model, batch).float()
    log_probs = padded_log_probs(model, batch)
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    weights, _ = rollout_importance_weights(
        batch.old_log_probs, batch.rollout_log_probs, batch.loss_mask, cap=2.0
    )
    loss, metrics = policy_objective(
        log_probs=log_probs,
        old_log_probs=batch.old_log_probs,
        advantages=batch.advantages,
        mask=batch.loss_mask,
        entropy=entropy,
        entropy_coef=ACTOR["objective"].entropy_coef,
        ref_log_probs=batch.ref_log_probs,
        kl_coef=ACTOR["objective"].kl_coef,
        importance_weights=weights,
        cu_seqlens=batch.cu_seqlens,
    )
    loss.backward()
    return metrics, {name: p.grad for name, p in model.named_parameters()}


def _assert_grads_close(got, expected):
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_ranks_got_balanced_shares(run):
    batch, res, _ = run
    assert res["is_training_backend"]
    assert sum(res["local_seq_counts"]) == batch.num_seqs
    assert min(res["local_seq_counts"]) >= 1


def test_log_probs_match_single_process(run):
    batch, res, _ = run
    expected = padded_log_probs(plain_model(CONFIGS["qwen2"]), batch).detach()
    torch.testing.assert_close(_per_seq(batch, res["log_probs"]), expected, rtol=1e-5, atol=1e-5)
    # The reference model is a frozen copy of the initial weights.
    torch.testing.assert_close(
        _per_seq(batch, res["ref_log_probs"]), expected, rtol=1e-5, atol=1e-5
    )


def test_bf16_mixed_precision_log_probs_are_close(run):
    batch, res, _ = run
    expected = padded_log_probs(plain_model(CONFIGS["qwen2"]), batch).detach()
    got = _per_seq(batch, res["log_probs_bf16"])
    assert not torch.equal(got, expected)  # really computed in bf16
    torch.testing.assert_close(got, expected, rtol=0.0, atol=0.05)


@pytest.mark.parametrize("budget", [SMALL_BUDGET, LARGE_BUDGET])
def test_loss_and_grads_match_single_process(run, budget):
    batch, res, _ = run
    metrics, grads = _reference_rl(batch)
    got_metrics, got_grads = res["grads_by_budget"][budget]
    for key in ("loss/total", "loss/pg", "loss/kl", "actor/entropy", "pg/clipfrac"):
        assert got_metrics[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    _assert_grads_close(got_grads, grads)


def test_micro_batching_changes_nothing(run):
    _, res, _ = run
    assert res["num_micro_batches", SMALL_BUDGET] >= 4
    assert res["num_micro_batches", LARGE_BUDGET] == 1
    small, large = res["grads_by_budget"][SMALL_BUDGET], res["grads_by_budget"][LARGE_BUDGET]
    assert small[0]["loss/total"] == pytest.approx(large[0]["loss/total"], rel=1e-5)
    _assert_grads_close(small[1], large[1])


def test_sft_mode_matches_single_process(run):
    batch, res, _ = run
    model = plain_model(CONFIGS["qwen2"])
    loss, _ = sft_objective(log_probs=padded_log_probs(model, batch), mask=batch.loss_mask)
    loss.backward()
    metrics, grads = res["sft"]
    assert metrics["loss/sft"] == pytest.approx(float(loss.detach()), rel=1e-5)
    _assert_grads_close(grads, {n: p.grad for n, p in model.named_parameters()})


def test_weight_buckets_reassemble_the_exact_state_dict(run):
    _, res, _ = run
    buckets = res["buckets"]
    expected = dict(plain_model(CONFIGS["qwen2"]).named_parameters())
    names = [name for bucket in buckets for name, _ in bucket]
    assert names == list(expected)
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 40_000 or len(bucket) == 1
    assert len(buckets) > 3
    for bucket in buckets:
        for name, tensor in bucket:
            assert torch.equal(tensor, expected[name].detach()), name


def test_train_steps_follow_schedule_and_clip(run):
    batch, res, _ = run
    steps = res["train_first"] + res["train_after"]
    lrs = [m["train/lr"] for m in steps]
    hand = [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4))]
    assert lrs == pytest.approx([ACTOR["lr"] * f for f in hand])
    assert lrs == pytest.approx([ACTOR["lr"] * lr_multiplier(i, _cfg()) for i in range(4)])
    _, grads = _reference_rl(batch)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    assert steps[0]["train/grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    assert steps[-1]["loss/total"] < steps[0]["loss/total"]
    assert all(m["perf/tokens_per_s"] > 0 for m in steps)


def _cfg():
    from rl_fsdp import FSDPConfig

    return FSDPConfig(**ACTOR)


def test_resume_reproduces_the_uninterrupted_run_exactly(run):
    _, res, _ = run
    assert res["resumed_step"] == 2
    for after, resumed in zip(res["train_after"], res["train_resumed"], strict=True):
        exact = {k: v for k, v in after.items() if not k.startswith("perf/")}
        assert {k: resumed[k] for k in exact} == exact
    for name, tensor in res["weights_final"].items():
        assert torch.equal(res["weights_resumed"][name], tensor), name


def test_exported_hf_dir_reloads_with_identical_logits(run):
    from transformers import AutoModelForCausalLM

    batch, res, workdir = run
    reloaded = AutoModelForCausalLM.from_pretrained(workdir / "hf", attn_implementation="sdpa")
    assert len(list((workdir / "hf").glob("model-*.safetensors"))) > 1
    for name, tensor in reloaded.named_parameters():
        assert torch.equal(tensor, res["weights_final"][name]), name
    direct = plain_model(CONFIGS["qwen2"])
    missing, unexpected = direct.load_state_dict(res["weights_final"], strict=False)
    assert not unexpected and missing == ["lm_head.weight"]  # tied to the embedding
    assert direct.lm_head.weight is direct.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(padded_logits(reloaded, batch), padded_logits(direct, batch))
        expected = padded_log_probs(reloaded, batch)
    got = _per_seq(batch, res["log_probs_final"])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The backend itself loads the exported directory (model_path) to the same log-probs.
    assert torch.equal(_per_seq(batch, res["log_probs_loaded"]), got)


def test_critic_values_loss_and_grad_norm_match_single_process(run):
    batch, res, _ = run
    model = plain_model(CONFIGS["qwen2"], seed=CRITIC["seed"], head="value")
    values = padded_logits(model, batch)[:, 0]
    got = _per_seq(batch, res["critic"]["values"])
    torch.testing.assert_close(got, values.detach(), rtol=1e-5, atol=1e-5)
    mask = batch.loss_mask
    loss = (0.5 * (values - batch.returns).square() * mask).sum() / mask.sum()
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    metrics = res["critic"]["metrics"]
    assert metrics["loss/value"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert metrics["train/grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)
