"""One rank without FSDP (rl_fsdp.master): float32 master parameters and a bf16 compute
copy give FSDP's numbers on one rank, and the backend's other paths (log-probs, resume,
export) keep working on it. Run on CPU in bf16, where FSDP on one rank is the default."""

from dataclasses import replace

import pytest
import torch
from fsdp_tiny import CONFIGS, tokens_batch

from rl_fsdp.config import FSDPConfig
from rl_fsdp.master import MasterWeights
from rl_fsdp.modeling import is_fsdp, uses_fsdp

UNTIED = {**CONFIGS["qwen2"], "tie_word_embeddings": False}
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist

    from rl_core.distributed import init_distributed

    yield init_distributed(device="cpu")
    dist.destroy_process_group()


def test_when_fsdp_is_used():
    cfg = FSDPConfig(model_config=CONFIGS["qwen2"], device="cpu")
    assert (uses_fsdp(cfg, 1, CPU), uses_fsdp(cfg, 1, CUDA), uses_fsdp(cfg, 2, CPU)) == (
        False,
        False,
        True,
    )
    assert uses_fsdp(replace(cfg, fsdp_on_one_rank=True), 1, CPU)
    assert uses_fsdp(replace(cfg, cpu_offload=True), 1, CUDA)
    assert uses_fsdp(replace(cfg, fsdp_on_one_rank=True), 1, CUDA)
    assert not uses_fsdp(replace(cfg, fsdp_on_one_rank=False), 1, CPU)
    with pytest.raises(ValueError, match="cpu_offload"):
        FSDPConfig(model_config=CONFIGS["qwen2"], cpu_offload=True, fsdp_on_one_rank=False)


def test_buffers_move_without_the_parameters():
    """Without FSDP the model's buffers (rotary frequencies) go to the device up front,
    not copied there in every forward; the parameters wait for MasterWeights."""
    from fsdp_tiny import plain_model

    from rl_fsdp.modeling import move_buffers

    model = plain_model(CONFIGS["qwen2"])
    assert any(True for _ in model.buffers())
    move_buffers(model, torch.device("meta"))
    assert all(b.device.type == "meta" for b in model.buffers())
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_master_weights_by_hand():
    """bf16 compute views inside, float32 data outside; two backwards summed in float32
    exactly as the sum of their bf16 gradients; refresh after an update."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    master = MasterWeights(model, torch.bfloat16, CPU)
    xs = [torch.randn(4, 8) for _ in range(2)]
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
    master.zero_grads()
    with master.computing():
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        for x in xs:
            model(x.bfloat16()).float().square().sum().backward()
            for total, param in zip(expected, model.parameters(), strict=True):
                total += param.grad.float()
            master.accumulate()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for total, param in zip(expected, model.parameters(), strict=True):
        assert torch.equal(param.grad, total)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # what an optimizer step does to the masters
    master.refresh()
    with master.computing():
        assert torch.equal(model[0].weight, (master.master[:64].view(8, 8)).bfloat16())
    master.zero_grads()
    with master.computing():
        pass
    assert all(p.grad is None for p in model.parameters())  # no backward: no gradients


def test_offload_keeps_weights_and_compute_copy_and_rebuilds_gradients():
    """Offloaded, the compute copy (what forward passes read first) and the float32
    parameters (what only the update reads) keep their bytes; the gradient buffers are
    freed, and back they hold zero per-pass gradients and no step's sum."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    master = MasterWeights(model, torch.bfloat16, CPU)
    with master.computing():
        model(torch.randn(2, 8).bfloat16()).float().sum().backward()
        master.accumulate()
    assert master.stashed() == ([master.compute], [master.master])
    kept = master.master.clone()
    master.free_gradients()
    assert [t.untyped_storage().nbytes() for t in master.gradient_buffers()] == [0, 0]
    assert torch.equal(master.master, kept)
    master.restore_gradients()
    assert not master.pass_grads.any() and not master.has_grads
    with master.computing():
        assert torch.equal(model.weight, kept[:64].view(8, 8).bfloat16())
    assert model.weight.grad is None
    float32 = MasterWeights(torch.nn.Linear(4, 4), torch.float32, CPU)
    assert float32.stashed() == ([float32.master], [])  # the compute copy is the master
    assert float32.gradient_buffers() == [float32.grads]


def test_gradients_sum_over_passes_without_zeroing_the_float32_buffer():
    """The first pass after zero_grads is copied into the float32 sum, later ones added:
    stale values in that buffer never leak into a step's gradient."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, bias=False)
    master = MasterWeights(model, torch.bfloat16, CPU)
    inputs = [torch.randn(2, 8).bfloat16() for _ in range(2)]
    expected = torch.zeros(8, 8)
    for step in range(2):
        master.zero_grads()
        master.grads.fill_(123.0)  # what an earlier step or an offload leaves there
        with master.computing():
            for x in inputs:
                model(x).float().sum().backward()
                if step == 0:  # the sum of the passes' bf16 gradients, in float32
                    expected += model.weight.grad.float()
                master.accumulate()
        assert torch.equal(model.weight.grad, expected)


def _train(world_of_one, steps: int = 2, **overrides):
    from rl_fsdp import FSDPBackend

    config = FSDPConfig(
        model_config=UNTIED, device="cpu", precision="bf16", lr=1e-2, max_tokens_per_micro_batch=48
    )
    backend = FSDPBackend(replace(config, **overrides), dist_info=world_of_one)
    batch = _rl_batch()
    assert len(backend.plan(batch, 48)) == 3
    losses = []
    for _ in range(steps):
        metrics = backend.train_step(batch)
        losses.append((metrics["loss/total"], metrics["train/grad_norm"]))
    return backend, losses


def _rl_batch():
    batch = tokens_batch()
    batch.advantages = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(3))
    return batch.with_global_denominators()


def _state(backend) -> dict[str, torch.Tensor]:
    def local(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    params = {k: local(v) for k, v in backend.model.state_dict().items()}
    grads = {f"{k}.grad": local(p.grad) for k, p in backend.model.named_parameters()}
    return {**params, **grads}


def test_same_numbers_as_fsdp_on_one_rank(world_of_one):
    """Two bf16 steps of three micro-batches: the same losses, grad norms, parameters and
    gradients bit for bit as FSDP2 on one rank (an untied model: with tied embeddings the
    shared weight's two contributions may round in another order)."""
    plain, plain_losses = _train(world_of_one, fsdp_on_one_rank=False)
    assert not is_fsdp(plain.model) and plain.master is not None
    sharded, sharded_losses = _train(world_of_one, fsdp_on_one_rank=True)
    assert is_fsdp(sharded.model)
    assert plain_losses == sharded_losses
    got, expected = _state(plain), _state(sharded)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_log_probs_resume_and_export_without_fsdp(world_of_one, tmp_path):
    """Log-probs use the updated compute copy; a checkpoint resumed into a fresh backend
    continues exactly; exported weights are the float32 masters."""
    backend, _ = _train(world_of_one, steps=1, fsdp_on_one_rank=False)
    batch = _rl_batch()
    before = backend.compute_log_probs(batch)
    backend.save_checkpoint(tmp_path / "ckpt")
    after_step = backend.train_step(batch)
    assert not torch.equal(backend.compute_log_probs(batch), before)  # updated weights used
    fresh, _ = _train(world_of_one, steps=0, fsdp_on_one_rank=False, seed=7)
    fresh.load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(fresh.compute_log_probs(batch), before)
    resumed = fresh.train_step(batch)
    assert (resumed["loss/total"], resumed["train/grad_norm"]) == (
        after_step["loss/total"],
        after_step["train/grad_norm"],
    )
    exported = {n: t for bucket in fresh.export_weights(bucket_bytes=1 << 20) for n, t in bucket}
    for name, param in backend.model.named_parameters():
        assert exported[name].dtype == torch.float32
        assert torch.equal(exported[name], param.detach()), name


def test_an_export_in_the_compute_dtype_sends_the_compute_copy(world_of_one, tmp_path):
    """Exported in bf16 (what engines of a bf16 run get), the tensors are the compute copy's
    views, no cast of their own, holding the float32 masters cast: after training steps,
    an offload and onload, and a checkpoint load into a fresh backend."""

    def exported(backend):
        buckets = backend.export_weights(bucket_bytes=1 << 20)
        return {name: tensor for bucket in buckets for name, tensor in bucket}

    def check(backend):
        compute = backend.master.compute.untyped_storage().data_ptr()
        for name, tensor in exported(backend).items():
            param = dict(backend.model.named_parameters())[name]
            assert tensor.untyped_storage().data_ptr() == compute, name
            assert torch.equal(tensor, param.detach().to(torch.bfloat16)), name

    backend, _ = _train(world_of_one, steps=2, fsdp_on_one_rank=False, export_dtype="bf16")
    check(backend)
    backend.offload()
    backend.onload()
    check(backend)
    backend.save_checkpoint(tmp_path / "ckpt")
    fresh, _ = _train(world_of_one, steps=0, fsdp_on_one_rank=False, export_dtype="bf16", seed=7)
    fresh.load_checkpoint(tmp_path / "ckpt")
    check(fresh)
    assert exported(fresh).keys() == exported(backend).keys()


def test_reference_and_critic_without_fsdp(world_of_one):
    """The frozen reference is a plain module in the compute dtype (no master copy) and
    gives the actor's log-probs before any update; the critic trains on master weights
    with the numbers of an FSDP2 critic."""
    from rl_fsdp import FSDPCritic

    actor, _ = _train(world_of_one, steps=0, fsdp_on_one_rank=False, reference=True)
    assert not is_fsdp(actor.ref_model)
    assert all(p.dtype == torch.bfloat16 for p in actor.ref_model.parameters())
    batch = _rl_batch()
    assert torch.equal(actor.compute_log_probs(batch, model="ref"), actor.compute_log_probs(batch))

    batch.returns = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(5))
    results = []
    for fsdp in (False, True):
        config = FSDPConfig(
            model_config=UNTIED,
            device="cpu",
            precision="bf16",
            lr=1e-2,
            max_tokens_per_micro_batch=48,
            fsdp_on_one_rank=fsdp,
        )
        critic = FSDPCritic(config, dist_info=world_of_one)
        assert (critic.master is None) == fsdp
        losses = [critic.train_step(batch)["loss/value"] for _ in range(2)]
        results.append((losses, critic.compute_values(batch)))
    (plain_losses, plain_values), (sharded_losses, sharded_values) = results
    assert plain_losses == sharded_losses
    assert torch.equal(plain_values, sharded_values)


def test_train_step_supplies_the_old_log_probs_of_an_on_policy_step(world_of_one):
    """With no old log-probs (rl-train's ``algorithm.old_log_probs: train_step``) the step
    uses its own forward's, detached: the same loss, grad norm and update as a step given
    the log-probs of a separate pass over the same weights, and it reports the mean gap to
    the engine's log-probs that the separate pass would have given."""
    from rl_fsdp import FSDPBackend

    config = FSDPConfig(model_config=UNTIED, device="cpu", lr=1e-2, max_tokens_per_micro_batch=48)
    results = []
    for recompute in (True, False):
        backend = FSDPBackend(config, dist_info=world_of_one)
        batch = _rl_batch()
        old = backend.compute_log_probs(batch)
        batch.rollout_log_probs = old + 0.1 * torch.randn(old.shape, generator=torch.Generator())
        gap = float((old - batch.rollout_log_probs).abs()[batch.loss_mask > 0].mean())
        if recompute:
            batch.old_log_probs = old
        metrics = backend.train_step(batch)
        results.append((metrics, gap, backend.compute_log_probs(batch)))
    (given, _, after_given), (own, gap, after_own) = results
    assert own["loss/total"] == pytest.approx(given["loss/total"], rel=1e-6)
    assert own["train/grad_norm"] == pytest.approx(given["train/grad_norm"], rel=1e-5)
    assert torch.allclose(after_own, after_given, atol=1e-6)  # the same update
    assert "mismatch/logprob_abs_diff_mean" not in given  # the loop reports it then
    assert own["mismatch/logprob_abs_diff_mean"] == pytest.approx(gap, rel=1e-5)
