"""Throughput levers of the GPU path, each checked on CPU against the path without it:
megatron's compiled SwiGLU (dense MLP and MoE experts) gives the unfused activation's
log-probs, loss and gradients."""

import pytest
import tiny
import torch

from rl_core.objective import Objective
from rl_megatron.backend import MegatronBackend
from rl_megatron.config import MegatronConfig

LENGTHS = [9, 14, 6, 11]


def _run(model_dirs, name: str, **overrides):
    config = MegatronConfig(
        hf_path=model_dirs[name][0],
        device="cpu",
        lr=1e-3,
        objective=Objective(entropy_coef=0.01),
        **overrides,
    )
    backend = MegatronBackend(config)
    assert backend.model.config.bias_activation_fusion is config.swiglu_fusion
    batch = tiny.random_batch(LENGTHS, seed=5)
    log_probs = backend.compute_log_probs(batch)
    return log_probs, backend.forward_backward(batch), backend.hf_gradients()


def _count_calls(monkeypatch, module, names: tuple[str, ...]) -> list[str]:
    calls = []
    for attr in names:
        original = getattr(module, attr)

        def counted(*args, _original=original, _attr=attr, **kwargs):
            calls.append(_attr)
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, attr, counted)
    return calls


@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe"])
def test_fused_swiglu_equals_unfused(world1, model_dirs, name, monkeypatch):
    from megatron.core.transformer import mlp

    calls = _count_calls(monkeypatch, mlp, ("bias_swiglu_impl", "weighted_bias_swiglu_impl"))
    plain_lp, plain_metrics, plain_grads = _run(model_dirs, name, swiglu_fusion=False)
    assert not calls
    fused_lp, fused_metrics, fused_grads = _run(model_dirs, name, swiglu_fusion=True)
    assert calls  # the fused path ran (weighted by router probabilities in MoE experts)
    torch.testing.assert_close(fused_lp, plain_lp, atol=1e-6, rtol=0)
    for key in ("loss/total", "loss/pg", "actor/entropy"):
        assert fused_metrics[key] == pytest.approx(plain_metrics[key], abs=1e-6), key
    assert fused_grads.keys() == plain_grads.keys()
    for hf_name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[hf_name], grad, atol=1e-6, rtol=1e-5, msg=hf_name)


def test_swiglu_fusion_defaults_by_device(model_dirs):
    path = model_dirs["qwen3"][0]
    assert MegatronConfig(hf_path=path, device="cuda").swiglu_fusion is True
    assert MegatronConfig(hf_path=path, device="cpu").swiglu_fusion is False
    assert MegatronConfig(hf_path=path, device="cpu", swiglu_fusion=True).swiglu_fusion is True


def _adamw_run(fused: bool, clip: bool) -> list[torch.Tensor]:
    """Two AdamW steps on fixed gradients: the first far above the clip norm, the second
    below it (so clipping changes the moments' mix and the result)."""
    from rl_megatron import optim

    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(33, 7, generator=gen)) for _ in range(2)]
    grads = [[scale * torch.randn(33, 7, generator=gen) for _ in params] for scale in (5.0, 0.01)]
    optimizer = torch.optim.AdamW(params, lr=1e-2, fused=fused)
    for step_grads in grads:
        for param, grad in zip(params, step_grads, strict=True):
            param.grad = grad.clone()
        norm = float(torch.stack([g.norm() for g in step_grads]).norm())
        with optim.clipped(optimizer, params, max_norm=1.0 if clip else 0.0, norm=norm):
            assert hasattr(optimizer, "grad_scale") == (fused and clip and norm > 1.0)
            optimizer.step()
        assert not hasattr(optimizer, "grad_scale")
    return [p.detach() for p in params]


def test_fused_adamw_clips_inside_its_kernel_like_a_separate_pass():
    separate = _adamw_run(fused=False, clip=True)  # foreach multiply, then AdamW
    in_kernel = _adamw_run(fused=True, clip=True)  # grad_scale of the fused kernel
    unclipped = _adamw_run(fused=True, clip=False)
    for ours, expected, free in zip(in_kernel, separate, unclipped, strict=True):
        torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-6)
        assert float((ours - free).abs().max()) > 1e-4  # clipping mattered
