"""One rank (TP=1, gloo world of 1): parity with HF, conversion round trip, training
invariances, SFT, critic, reference model, checkpoint resume, offload."""

import json

import pytest
import tiny
import torch
from safetensors.torch import load_file

from rl_core.objective import Objective, policy_objective
from rl_megatron import checkpoint
from rl_megatron.backend import MegatronBackend
from rl_megatron.config import MegatronConfig

LENGTHS = [9, 14, 6, 11]


def make_backend(model_dirs, name="qwen3", **overrides) -> MegatronBackend:
    settings = dict(hf_path=model_dirs[name][0], device="cpu", lr=1e-3, clip_grad=0.0)
    return MegatronBackend(MegatronConfig(**{**settings, **overrides}))


def hf_files(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in directory.glob("*.safetensors"):
        tensors.update(load_file(str(path)))
    return tensors


@pytest.mark.parametrize("name", ["qwen2-tied", "qwen3", "llama", "qwen3-moe"])
def test_log_probs_equal_hf_model(world1, model_dirs, name):
    backend = make_backend(model_dirs, name, max_tokens_per_micro_batch=20)
    batch = tiny.random_batch(LENGTHS, seed=1)
    expected = tiny.hf_log_probs(model_dirs[name][1], batch).detach()
    got = backend.compute_log_probs(batch)
    ends = batch.cu_seqlens[1:].long() - 1
    got[ends] = 0.0
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", ["qwen2-tied", "qwen3", "llama", "qwen3-moe"])
def test_export_round_trip_is_exact(world1, model_dirs, name, tmp_path):
    backend = make_backend(model_dirs, name)
    original = hf_files(model_dirs[name][0])
    buckets = list(backend.export_weights(bucket_bytes=40_000))
    exported = dict(pair for bucket in buckets for pair in bucket)
    assert set(exported) == set(original)
    assert all(torch.equal(exported[n], original[n]) for n in original)
    for bucket in buckets:  # only a single oversized tensor may exceed the bound
        assert len(bucket) == 1 or sum(t.numel() * 4 for _, t in bucket) <= 40_000
    params = list(backend.model.parameters())
    kept = [p.detach().clone() for p in params]
    with torch.no_grad():  # exported tensors are copies: changing the model leaves them
        for param in params:
            param.add_(1.0)
        assert all(torch.equal(exported[n], original[n]) for n in original)
        for param, value in zip(params, kept, strict=True):
            param.copy_(value)
    backend.export_hf(tmp_path / "out", bucket_bytes=100_000)
    backend.export_hf(tmp_path / "out")  # replacing an existing export is atomic too
    saved = hf_files(tmp_path / "out")
    assert all(torch.equal(saved[n], original[n]) for n in original)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left


@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe"])
def test_policy_loss_and_grads_equal_hf(world1, model_dirs, name):
    """Loss from rl_core on Megatron log-probs, and its gradient, equal the HF model's."""
    backend = make_backend(model_dirs, name)
    batch = tiny.random_batch(LENGTHS, seed=2)
    metrics = backend.forward_backward(batch)
    hf_model = model_dirs[name][1]
    hf_model.zero_grad()
    log_probs = tiny.hf_log_probs(hf_model, batch)
    loss, _ = policy_objective(
        log_probs=log_probs,
        old_log_probs=batch.old_log_probs,
        advantages=batch.advantages,
        mask=batch.loss_mask,
        num_tokens=batch.global_num_tokens,
        cu_seqlens=batch.cu_seqlens,
    )
    loss.backward()
    assert metrics["loss/total"] == pytest.approx(float(loss), abs=1e-5)
    assert metrics["pg/clipfrac"] > 0  # the clipped branch is exercised
    grads, expected = backend.hf_gradients(), tiny.hf_named_grads(hf_model)
    assert set(grads) == set(expected)
    for hf_name, grad in expected.items():
        torch.testing.assert_close(grads[hf_name], grad, atol=1e-5, rtol=1e-4, msg=hf_name)
    hf_norm = torch.stack([p.grad.norm() for p in hf_model.parameters()]).norm()
    assert backend.grad_norm() == pytest.approx(float(hf_norm), rel=1e-5)


def test_rollout_importance_weights_scale_the_policy_loss(world1, model_dirs):
    batch = tiny.random_batch(LENGTHS, seed=10)
    plain = make_backend(model_dirs, "qwen3").forward_backward(batch)
    corrected = Objective(rollout_is_level="token", rollout_is_cap=2.0)
    backend = make_backend(model_dirs, "qwen3", objective=corrected, max_tokens_per_micro_batch=20)
    batch.rollout_log_probs = batch.old_log_probs - 0.5  # every weight exp(0.5) < cap
    weighted = backend.forward_backward(batch)
    assert weighted["loss/pg"] == pytest.approx(plain["loss/pg"] * 1.6487213, rel=1e-5)
    assert weighted["mismatch/weight_mean"] == pytest.approx(1.6487213, rel=1e-5)
    batch.rollout_log_probs = batch.old_log_probs - 1.0  # exp(1) > 2: every weight capped
    assert backend.forward_backward(batch)["loss/pg"] == pytest.approx(
        plain["loss/pg"] * 2, rel=1e-5
    )


def test_micro_batches_give_the_full_batch_loss_and_grads(world1, model_dirs):
    backend = make_backend(model_dirs, "qwen2-tied")
    batch = tiny.random_batch(LENGTHS, seed=3)
    full = backend.forward_backward(batch)
    full_grads = backend.hf_gradients()
    backend.optimizer.zero_grad()
    backend.config.max_tokens_per_micro_batch = 15  # 3 micro-batches
    parts = backend.forward_backward(batch)
    assert parts["loss/total"] == pytest.approx(full["loss/total"], abs=1e-6)
    for name, grad in backend.hf_gradients().items():
        torch.testing.assert_close(grad, full_grads[name], atol=1e-6, rtol=1e-5)


def test_sft_steps_lower_the_loss(world1, model_dirs):
    backend = make_backend(model_dirs, "llama", objective=Objective(mode="sft"), lr=3e-3)
    batch = tiny.random_batch(LENGTHS, seed=4)
    losses = [backend.train_step(batch)["loss/sft"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.05
    nll = -(backend.compute_log_probs(batch) * batch.loss_mask).sum() / batch.loss_mask.sum()
    assert float(nll) < losses[0]


def test_critic_learns_returns(world1, model_dirs):
    backend = make_backend(model_dirs, "qwen3", critic=True, lr=1e-3, value_clip=0.5)
    batch = tiny.random_batch(LENGTHS, seed=5)
    batch.returns = torch.full_like(batch.loss_mask, 0.7)
    values = backend.compute_values(batch)
    assert torch.equal(values, torch.zeros_like(values))  # zero-initialised head
    batch.old_values = values
    first = backend.train_step(batch)
    assert first["loss/value"] == pytest.approx(0.5 * 0.7**2, abs=1e-6)
    for _ in range(3):
        last = backend.train_step(batch)
    assert last["loss/value"] < first["loss/value"]
    with pytest.raises(ValueError, match="critic"):
        backend.export_weights(bucket_bytes=1 << 20)
    with pytest.raises(ValueError, match="critic has no log-probs"):
        backend.compute_log_probs(batch)


def test_critic_resumes_from_a_distributed_checkpoint(world1, model_dirs, tmp_path):
    batch = tiny.random_batch(LENGTHS, seed=5)
    batch.returns = torch.full_like(batch.loss_mask, 0.7)
    straight = make_backend(model_dirs, "qwen3", critic=True, lr=1e-2)
    straight.train_step(batch)
    straight.save_checkpoint(tmp_path / "critic")
    expected = straight.train_step(batch)
    resumed = make_backend(model_dirs, "qwen3", critic=True, lr=1e-2)
    resumed.load_checkpoint(tmp_path / "critic")
    assert resumed.train_step(batch) == expected
    assert torch.equal(resumed.compute_values(batch), straight.compute_values(batch))


def test_reference_log_probs_come_from_ref_weights(world1, model_dirs, tmp_path):
    ref_path, with_kl = model_dirs["qwen3-ref"][0], Objective(kl_coef=0.1)
    backend = make_backend(model_dirs, "qwen3", ref_path=ref_path, objective=with_kl)
    batch = tiny.random_batch(LENGTHS, seed=6)
    actor = backend.compute_log_probs(batch)
    ref = backend.compute_log_probs(batch, model="ref")
    mask = batch.loss_mask.bool()
    expected_ref = tiny.hf_log_probs(model_dirs["qwen3-ref"][1], batch).detach()
    torch.testing.assert_close(ref[mask], expected_ref[mask], atol=2e-5, rtol=0)
    assert not torch.allclose(actor[mask], ref[mask])
    torch.testing.assert_close(backend.compute_log_probs(batch), actor, atol=0, rtol=0)
    batch.ref_log_probs = ref
    assert "loss/kl" in backend.train_step(batch)
    trained = backend.compute_log_probs(batch)
    assert not torch.allclose(trained[mask], actor[mask])
    backend.save_checkpoint(tmp_path / "before")  # the starting reference: not saved
    backend.update_reference()  # rl-train's algorithm.ref_update_interval
    torch.testing.assert_close(backend.compute_log_probs(batch, model="ref"), trained)
    backend.save_checkpoint(tmp_path / "after")  # the refreshed one: saved with the weights
    assert not (tmp_path / "before/reference").exists()
    for saved, expected in (("after", trained), ("before", ref)):
        resumed = make_backend(model_dirs, "qwen3", ref_path=ref_path, objective=with_kl)
        resumed.load_checkpoint(tmp_path / saved)
        got = resumed.compute_log_probs(batch, model="ref")
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="needs a reference"):
        make_backend(model_dirs, "qwen3").update_reference()


def test_resume_equals_uninterrupted(world1, model_dirs, tmp_path):
    batches = [tiny.random_batch(LENGTHS, seed=s) for s in (7, 8)]
    straight = make_backend(model_dirs, "qwen2-tied", clip_grad=1.0)
    straight.train_step(batches[0])
    straight.save_checkpoint(tmp_path / "ckpt")
    expected = straight.train_step(batches[1])
    resumed = make_backend(model_dirs, "qwen2-tied", clip_grad=1.0)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 1
    assert resumed.train_step(batches[1]) == expected
    for (name, a), b in zip(
        straight.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing left aside
    with pytest.raises(ValueError, match="mode"):
        sft = make_backend(model_dirs, "qwen2-tied", objective=Objective(mode="sft"))
        sft.load_checkpoint(tmp_path / "ckpt")
    checkpoint.save_sharded(tmp_path / "per_rank", {"step": 1}, {"mode": "policy"})
    with pytest.raises(ValueError, match="not a megatron distributed checkpoint"):
        resumed.load_checkpoint(tmp_path / "per_rank")


def test_offload_onload_keeps_state(world1, model_dirs):
    backend = make_backend(model_dirs, "qwen3")
    batch = tiny.random_batch(LENGTHS, seed=9)
    backend.train_step(batch)
    before = backend.compute_log_probs(batch)
    backend.offload()
    assert all(p.device.type == "cpu" for p in backend.params)
    backend.onload()
    torch.testing.assert_close(backend.compute_log_probs(batch), before, atol=0, rtol=0)
    assert backend.train_step(batch)["loss/total"] == pytest.approx(
        backend.forward_backward(batch)["loss/total"], abs=1.0
    )


def test_only_the_parameters_the_patterns_train_change(world1, model_dirs):
    """train_only / freeze by HF names (rl-train's model.train_only / model.freeze): the
    optimizer holds only the trained parameters and a step changes only them; a fused
    parameter whose sources the patterns split is refused."""
    from rl_core.freezing import is_trained
    from rl_megatron.weights import hf_sources

    patterns = {"train_only": ("mlp", "embed"), "freeze": (r"layers\.1\.",)}
    backend = make_backend(model_dirs, "qwen3", lr=1e-2, **patterns)
    sources = hf_sources(backend.model, backend.shape, backend.layout)
    expected = {n for n, hf in sources.items() if all(is_trained(h, **patterns) for h in hf)}
    assert "decoder.layers.0.mlp.linear_fc1.weight" in expected
    assert not any(".layers.1." in n for n in expected)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    backend.train_step(tiny.random_batch(LENGTHS, seed=3))
    changed = {n for n, p in backend.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == expected
    assert len(backend.params) == len(expected)
    with pytest.raises(ValueError, match=r"linear_qkv\.weight fuses"):
        make_backend(model_dirs, "qwen3", train_only=("q_proj",))
