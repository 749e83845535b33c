"""bf16 mixed precision (rl_megatron.precision) on CPU: fp32 main gradients summed over
micro-batches, fp32 master weights stepped and rounded into the bf16 parameters, and the
backend in precision="bf16" close to the fp32 HF model.

Tolerances for bf16 against fp32: mean |Δ log-prob| < 0.02, max < 0.15 (as on GPU);
gradients within 5% in global norm.
"""

import pytest
import tiny
import torch

from rl_core.objective import Objective
from rl_megatron.backend import MegatronBackend
from rl_megatron.config import MegatronConfig
from rl_megatron.precision import MasterWeightsOptimizer, finish_accumulation

LENGTHS = [9, 14, 6, 11]


def _bf16_linear(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 4, bias=True).to(torch.bfloat16)


def test_main_grads_sum_micro_batches_in_fp32():
    layer = _bf16_linear()
    optimizer = MasterWeightsOptimizer(list(layer.parameters()), torch.optim.SGD)
    inputs = [torch.randn(3, 8, dtype=torch.bfloat16) for _ in range(3)]
    expected = [torch.zeros(p.shape) for p in layer.parameters()]
    for x in inputs:
        for total, g in zip(
            expected, torch.autograd.grad(layer(x).sum(), layer.parameters()), strict=True
        ):
            total += g.float()  # each micro-batch's bf16 gradient, summed in fp32
    for x in inputs:
        layer(x).sum().backward()
    for param, total, master in zip(layer.parameters(), expected, optimizer.masters, strict=True):
        assert param.grad is None and param.main_grad.dtype == torch.float32
        torch.testing.assert_close(param.main_grad, total, atol=0, rtol=0)
        assert master.grad is param.main_grad
    optimizer.zero_grad()  # marks the buffers stale; the next backward overwrites them
    x = inputs[0]
    layer.weight.requires_grad_(False)  # only the bias gets a gradient this time
    layer(x).sum().backward()
    finish_accumulation(layer.parameters())  # zeroes the one no backward wrote
    assert not layer.weight.main_grad.any()
    bias_grad = torch.autograd.grad(layer(x).sum(), layer.bias)[0].float()
    torch.testing.assert_close(layer.bias.main_grad, bias_grad, atol=0, rtol=0)


def test_master_weights_keep_updates_below_bf16_resolution():
    layer = _bf16_linear()
    start = [p.detach().float().clone() for p in layer.parameters()]
    optimizer = MasterWeightsOptimizer(
        list(layer.parameters()), lambda ps: torch.optim.SGD(ps, lr=1.0)
    )
    for _ in range(4):  # each update 1e-4: below bf16's spacing (2^-8 relative) near 0.3
        for p in layer.parameters():
            p.main_grad.fill_(1e-4)
        optimizer.step()
    for p, master, first in zip(layer.parameters(), optimizer.masters, start, strict=True):
        torch.testing.assert_close(master, first - 4e-4, atol=1e-6, rtol=0)
        assert torch.equal(p.detach(), master.to(torch.bfloat16))


SFT = Objective(mode="sft")


def _backend(model_dirs, name="qwen3", **overrides) -> MegatronBackend:
    settings = dict(hf_path=model_dirs[name][0], device="cpu", lr=1e-3, clip_grad=0.0)
    return MegatronBackend(MegatronConfig(**{**settings, **overrides}))


def test_precision_is_validated(model_dirs):
    path = model_dirs["qwen3"][0]
    assert MegatronConfig(hf_path=path, device="cpu").precision == "fp32"
    assert MegatronConfig(hf_path=path, device="cuda").precision == "bf16"
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16"):
        MegatronConfig(hf_path=path, device="cpu", precision="fp16")


@pytest.mark.parametrize("name", ["qwen3", "qwen2-tied", "qwen3-moe"])
def test_bf16_backend_matches_fp32(world1, model_dirs, tmp_path, name):
    batch = tiny.random_batch(LENGTHS, seed=2)
    mask = batch.loss_mask.bool()
    fp32 = _backend(model_dirs, name, objective=SFT)
    fp32.forward_backward(batch)
    backend = _backend(
        model_dirs, name, objective=SFT, precision="bf16", max_tokens_per_micro_batch=20
    )
    assert {p.dtype for p in backend.model.parameters()} == {torch.bfloat16}
    diff = (backend.compute_log_probs(batch) - fp32.compute_log_probs(batch))[mask].abs()
    assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.15, (diff.mean(), diff.max())
    backend.forward_backward(batch)  # 2 micro-batches, summed in the fp32 main grads
    grads, expected = backend.hf_gradients(), fp32.hf_gradients()
    assert {g.dtype for g in grads.values()} == {torch.float32}
    error = torch.stack([(grads[n] - expected[n]).norm() for n in expected]).norm()
    assert float(error) < 0.05 * float(torch.stack([g.norm() for g in expected.values()]).norm())
    backend.optimizer.zero_grad()
    losses = [backend.train_step(batch)["loss/sft"] for _ in range(3)]
    assert losses[-1] < losses[0]
    masters = [m.clone() for m in backend.optimizer.masters]
    backend.save_checkpoint(tmp_path / "ckpt")
    backend.train_step(batch)
    backend.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(m, s) for m, s in zip(backend.optimizer.masters, masters, strict=True))
    params = list(backend.params)
    assert all(
        torch.equal(p.detach(), m.to(torch.bfloat16)) for p, m in zip(params, masters, strict=True)
    )


def test_bf16_critic_offload_and_onload(world1, model_dirs):
    critic = _backend(model_dirs, critic=True, precision="bf16", lr=1e-2)
    batch = tiny.random_batch(LENGTHS, seed=5)
    batch.returns = torch.full_like(batch.loss_mask, 0.7)
    critic.offload()
    critic.onload()
    losses = [critic.train_step(batch)["loss/value"] for _ in range(3)]
    assert losses[-1] < losses[0]
    values = critic.compute_values(batch)
    assert values.dtype == torch.float32 and values.abs().max() > 0.01
    for param, master in zip(critic.params, critic.optimizer.masters, strict=True):
        assert master.grad is param.main_grad  # still linked after the moves


def test_checkpoints_resume_across_precisions(world1, model_dirs, tmp_path):
    """A bf16 checkpoint resumed in fp32 gets the fp32 masters, an fp32 one resumed in bf16
    gets its fp32 weights as masters: nothing is rounded through bf16 on the way."""
    batch = tiny.random_batch(LENGTHS, seed=6)
    bf16 = _backend(model_dirs, objective=SFT, precision="bf16")
    bf16.train_step(batch)
    bf16.save_checkpoint(tmp_path / "bf16")
    fp32 = _backend(model_dirs, objective=SFT)
    fp32.load_checkpoint(tmp_path / "bf16")
    assert all(torch.equal(p, m) for p, m in zip(fp32.params, bf16.optimizer.masters, strict=True))
    fp32.train_step(batch)
    fp32.save_checkpoint(tmp_path / "fp32")
    bf16.load_checkpoint(tmp_path / "fp32")
    assert all(torch.equal(m, p) for m, p in zip(bf16.optimizer.masters, fp32.params, strict=True))


FOLD_CHECK = """
import torch
from rl_megatron._triton_fold import _BLOCK, fold

gen = torch.Generator().manual_seed(0)
empty = torch.ones(0)
fold(torch.ones(0, dtype=torch.bfloat16), empty, accumulate=True)  # nothing to launch
for numel in (1, _BLOCK - 1, _BLOCK + 1, 3 * _BLOCK + 5):
    for dtype in (torch.bfloat16, torch.float16):
        grad = (torch.randn(numel, generator=gen) * 7).to(dtype)
        start = torch.randn(numel, generator=gen) * 1e-3
        for accumulate in (False, True):
            main = start.clone()
            fold(grad, main, accumulate=accumulate)
            expected = start.clone().add_(grad) if accumulate else grad.float()
            assert torch.equal(main, expected), (numel, dtype, accumulate)
            assert not torch.equal(main, start)
print("folded")
"""


def test_triton_fold_equals_torch_copy_and_add_bit_for_bit():
    """The CUDA main-gradient kernel (run on CPU by Triton's interpreter, in a fresh
    interpreter since the variable is read when the kernel is defined) gives torch's
    cross-dtype copy and add exactly, at sizes around its block."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = os.environ | {"TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", FOLD_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "folded" in done.stdout, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_main_grad_fold_on_cuda_equals_torch():
    """On CUDA the hook folds through the Triton kernel; same values as torch's copy/add."""
    from rl_megatron import precision

    half = torch.zeros(2, device="cuda", dtype=torch.bfloat16)
    assert precision._triton_folds(torch.zeros(2, device="cuda"), half)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((151936, 1536), (1536,), (3, 5)):
        grad = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
        start = torch.randn(shape, device="cuda", generator=gen)
        for accumulate in (False, True):
            main = start.clone()
            precision.fold_into_main_grad(main, grad, accumulate=accumulate)
            expected = start.clone().add_(grad) if accumulate else grad.float()
            assert torch.equal(main, expected), (shape, accumulate)
