"""Throughput levers of the GPU path, each checked on CPU against the path without it:
megatron's compiled SwiGLU (dense MLP and MoE experts) gives the unfused activation's
log-probs, loss and gradients; so do the compiled transformer layers (whole, under full
recompute, and norms only in MoE layers), which also run as one graph each."""

import logging

import pytest
import tiny
import torch

from rl_core.objective import Objective
from rl_megatron.backend import MegatronBackend
from rl_megatron.config import MegatronConfig

LENGTHS = [9, 14, 6, 11]


def _run(model_dirs, name: str, batches=(LENGTHS,), graphs: list | None = None, **overrides):
    """Log-probs, forward/backward metrics and HF-named gradients of each batch (lengths);
    ``graphs`` gets the count of torch.compile graphs after each batch."""
    config = MegatronConfig(
        hf_path=model_dirs[name][0],
        device="cpu",
        lr=1e-3,
        objective=Objective(entropy_coef=0.01),
        **overrides,
    )
    backend = MegatronBackend(config)
    assert backend.model.config.bias_activation_fusion is config.swiglu_fusion
    results = []
    for seed, lengths in enumerate(batches, start=5):
        batch = tiny.random_batch(lengths, seed=seed)
        log_probs = backend.compute_log_probs(batch)
        results.append((log_probs, backend.forward_backward(batch), backend.hf_gradients()))
        backend.optimizer.zero_grad()
        if graphs is not None:
            from torch._dynamo.utils import counters

            graphs.append(counters["stats"]["unique_graphs"])
    return results if len(batches) > 1 else results[0]


def _assert_same(got, expected, *, atol: float) -> None:
    """Same log-probs, loss terms and gradients (``atol``; gradients also rtol 1e-5)."""
    (got_lp, got_metrics, got_grads), (lp, metrics, grads) = got, expected
    torch.testing.assert_close(got_lp, lp, atol=atol, rtol=0)
    for key in ("loss/total", "loss/pg", "actor/entropy"):
        assert got_metrics[key] == pytest.approx(metrics[key], abs=atol), key
    assert got_grads.keys() == grads.keys()
    for hf_name, grad in grads.items():
        torch.testing.assert_close(got_grads[hf_name], grad, atol=atol, rtol=1e-5, msg=hf_name)


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
    fused = _run(model_dirs, name, swiglu_fusion=True)
    assert calls  # the fused path ran (weighted by router probabilities in MoE experts)
    _assert_same(fused, (plain_lp, plain_metrics, plain_grads), atol=1e-6)


FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform"}
WHOLE, NORMS_ONLY = (
    {"whole_layers": 2, "norms_only_layers": 0},
    {"whole_layers": 0, "norms_only_layers": 2},
)
# name -> (model, MegatronConfig.megatron, compiled layers, graphs): a graph for training
# and one for log-probs (no grad); full recompute adds the checkpoint's no-grad forward;
# norms only: one per norm width (hidden; q/k heads of 4 and 2) and grad mode
COMPILED_CASES = {
    "dense": ("qwen3", {}, WHOLE, 2),
    "dense-bf16": ("qwen3", {}, WHOLE, 2),  # fp32 main gradients from the compiled backward
    "full-recompute": ("qwen3", FULL_RECOMPUTE | {"recompute_num_layers": 1}, WHOLE, 3),
    "moe": ("qwen3-moe", {}, NORMS_ONLY, 6),
}


@pytest.mark.parametrize("case", sorted(COMPILED_CASES))
def test_compiled_layers_equal_eager_without_graph_breaks(world1, model_dirs, case):
    """Two batches of different shapes: the second compiles no graph (the first's serve
    its shapes), no graph break, and the eager path's log-probs, loss and gradients (float32:
    inductor's fused kernels reorder sums, measured <= 5e-7; bf16: they keep float32
    between fused operations where eager rounds each one, measured <= 3e-3)."""
    from torch._dynamo.utils import counters

    from rl_core.compiling import compile_report

    name, options, layers, graphs = COMPILED_CASES[case]
    batches, precision = (LENGTHS, [7, 20, 3]), "bf16" if "bf16" in case else "fp32"
    eager = _run(model_dirs, name, batches, megatron=options, precision=precision)
    torch._dynamo.reset()  # graphs of earlier cases would be reused (same code, same guards)
    counters.clear()
    counts = []
    compiled = _run(
        model_dirs,
        name,
        batches,
        counts,
        megatron=options,
        precision=precision,
        compile_layers=True,
    )
    for got, expected in zip(compiled, eager, strict=True):  # bf16: fused kernels round less
        _assert_same(got, expected, atol=2e-6 if precision == "fp32" else 1e-2)
    report = compile_report()
    assert report["graph_breaks"] == 0, report["break_reasons"]
    assert not report["failures"]
    assert counts == [graphs, graphs]
    assert _compiled_layers(model_dirs, name, options) == layers


def _compiled_layers(model_dirs, name, options) -> dict:
    config = MegatronConfig(
        hf_path=model_dirs[name][0], device="cpu", megatron=options, compile_layers=True
    )
    return MegatronBackend(config).compiled_layers


def test_a_layer_that_fails_to_compile_runs_eager_logged_once(world1, model_dirs, caplog):
    """A compiler that raises: both layers (one class) fall back to eager after one log
    line, and the step equals the eager one."""
    from rl_megatron import compiled_layers

    def broken_compiler(graph, example_inputs):
        raise RuntimeError("no compiler here")

    expected = _run(model_dirs, "qwen3")
    config = MegatronConfig(
        hf_path=model_dirs["qwen3"][0],
        device="cpu",
        lr=1e-3,
        objective=Objective(entropy_coef=0.01),
    )
    backend = MegatronBackend(config)
    assert compiled_layers.compile_layers(backend.chunks, backend=broken_compiler) == {
        "whole_layers": 2,
        "norms_only_layers": 0,
    }
    failures_before = len(compiled_layers.COMPILE_FAILURES)
    batch = tiny.random_batch(LENGTHS, seed=5)
    with caplog.at_level(logging.WARNING, logger=compiled_layers.__name__):
        got = (backend.compute_log_probs(batch), backend.forward_backward(batch))
        backend.compute_log_probs(batch)
    got = (*got, backend.hf_gradients())
    lines = [r for r in caplog.records if "running it eager" in r.getMessage()]
    assert len(lines) == 1 and "no compiler here" in lines[0].getMessage()
    assert len(compiled_layers.COMPILE_FAILURES) == failures_before + 1
    assert compiled_layers.compiled_count(backend.chunks) == (0, 2)
    _assert_same(got, expected, atol=1e-6)


def test_swiglu_fusion_defaults_by_device(model_dirs):
    path = model_dirs["qwen3"][0]
    assert MegatronConfig(hf_path=path, device="cuda").swiglu_fusion is True
    assert MegatronConfig(hf_path=path, device="cpu").swiglu_fusion is False
    assert MegatronConfig(hf_path=path, device="cpu", swiglu_fusion=True).swiglu_fusion is True
    assert MegatronConfig(hf_path=path, device="cuda").compile_layers is True
    assert MegatronConfig(hf_path=path, device="cpu").compile_layers is False


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


def _angles(length: int, dim: int, *, interleaved: bool) -> torch.Tensor:
    """megatron's rotary angles ``[s, 1, 1, dim]`` (its RotaryEmbedding.get_emb layout)."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    if interleaved:
        return freqs.repeat_interleave(2, dim=-1)[:, None, None, :]
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [16, 8])  # whole head; GLM-4's partial rope
def test_rotary_table_rotates_as_megatron_bit_for_bit(interleaved, dtype, rot_dim):
    """The table path's queries and their gradient equal megatron's angles path exactly."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from rl_megatron.rotary import apply_rotary_from_table, cos_sin_table

    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(37, 3, 4, 16, generator=gen) * 3).to(dtype).requires_grad_(True)
    freqs = _angles(37, rot_dim, interleaved=interleaved)
    upstream = torch.randn(37, 3, 4, 16, generator=gen).to(dtype)
    table = cos_sin_table(freqs, dtype)
    assert table.shape == (37, 1, 1, 2, rot_dim) and table.dtype == dtype
    outputs, grads = [], []
    for rotate in (
        lambda: _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved),
        lambda: apply_rotary_from_table(t, table, interleaved=interleaved),
    ):
        out = rotate()
        outputs.append(out.detach())
        grads.append(torch.autograd.grad(out, t, upstream)[0])
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(grads[0], grads[1])
    assert not torch.equal(outputs[1][..., :rot_dim], t.detach()[..., :rot_dim])  # rotated
    assert torch.equal(outputs[1][..., rot_dim:], t.detach()[..., rot_dim:])  # passed


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["qwen3", "qwen2-tied", "llama"])
def test_rotary_table_equals_megatron_rotary(world1, model_dirs, name, precision, monkeypatch):
    """The backend with the cos/sin table gives megatron's rotary log-probs, loss and
    gradients to the bit, and no layer takes cos/sin of the angles any more."""
    from megatron.core.models.common.embeddings import rope_utils

    calls = _count_calls(monkeypatch, rope_utils, ("_apply_rotary_pos_emb_bshd",))
    angles = _run(model_dirs, name, precision=precision, rotary_table=False)
    assert calls  # megatron's path: each layer's queries and keys
    calls.clear()
    table = _run(model_dirs, name, precision=precision, rotary_table=True)
    assert not calls
    _assert_same(table, angles, atol=0)
    assert all(torch.equal(table[2][key], grad) for key, grad in angles[2].items())


def test_rotary_table_is_made_once_per_length_and_skipped_for_mla(world1, model_dirs):
    """One table per sequence length (cached, as megatron caches its angles), in the
    parameters' dtype; MLA models keep megatron's own rotary path."""
    config = MegatronConfig(hf_path=model_dirs["qwen3"][0], device="cpu", precision="bf16")
    rotary = MegatronBackend(config).model.rotary_pos_emb
    table = rotary(24)
    assert table.shape == (24, 1, 1, 2, 16) and table.dtype == torch.bfloat16
    assert rotary(24) is table and rotary(32).shape[0] == 32
    assert rotary(24, packed_seq=True).shape == (24, 1, 1, 16)  # thd keeps the angles
    mla = MegatronConfig(hf_path=model_dirs["deepseek_v3"][0], device="cpu")
    from rl_megatron.rotary import table_applies

    assert not table_applies(MegatronBackend(mla).model)


def test_real_row_logits_are_a_view_of_the_head_output(world1, model_dirs):
    """The LM head's ``[1, N_held, V]`` output reaches the loss as a view (squeeze): its
    backward hands the gradient over instead of copying it into a zeroed buffer (select's
    backward, 1.2 ms a step on the 1.5B shape)."""
    from rl_megatron.forward import forward_logits

    backend = MegatronBackend(MegatronConfig(hf_path=model_dirs["qwen3"][0], device="cpu"))
    batch = tiny.random_batch(LENGTHS, seed=5)
    logits, held = forward_logits(backend.model, batch.tokens, batch.cu_seqlens)
    assert logits.shape == (sum(LENGTHS), backend.shape.padded_vocab_size)
    assert type(logits.grad_fn).__name__.startswith("Squeeze"), logits.grad_fn
    assert torch.equal(held, torch.arange(sum(LENGTHS)))
