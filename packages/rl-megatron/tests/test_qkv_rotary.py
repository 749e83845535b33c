"""The fused q/k/v rotary (rl_megatron.qkv_rotary) against megatron's split and the table
rotary: its Triton kernels on CPU through Triton's interpreter, the backend with and
without it on CPU, and on GPU the kernels, the compiled op and the compiled layers."""

import os
import subprocess
import sys

import pytest
import tiny
import torch
import torch.multiprocessing as mp
from gpu_job import LENGTHS as GPU_LENGTHS
from test_levers import _assert_same, _count_calls, _run

from rl_core.distributed import free_port

# (s, b, groups, queries per group, head dim, rotary channels): GQA with rows not a multiple
# of the kernel's block, one query per group, head dims that are not powers of two (whole
# and partial rope), partial rope (the rest passes through)
SHAPES = [
    (7, 3, 2, 2, 16, 16),
    (19, 1, 2, 1, 24, 16),
    (6, 2, 1, 2, 24, 24),
    (5, 2, 1, 3, 16, 8),
    (33, 2, 2, 6, 32, 32),
]

KERNEL_CHECK = """
import torch
from rl_megatron._triton_qkv_rotary import rotate_qkv, rotate_qkv_backward
from rl_megatron.qkv_rotary import split_and_rotate
from rl_megatron.rotary import cos_sin_table

def table_of(seq, rot, dtype):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot, 2).float() / rot)
    freqs = torch.outer(torch.arange(seq).float(), inv_freq)
    return cos_sin_table(torch.cat([freqs, freqs], -1)[:, None, None, :], dtype)

gen = torch.Generator().manual_seed(0)
for seq, batch, groups, per_group, head_dim, rot in SHAPES:
    for dtype in (torch.float16, torch.float32, torch.bfloat16):
        mixed = (torch.randn(seq, batch, groups, (per_group + 2) * head_dim, generator=gen) * 3)
        mixed = mixed.to(dtype).requires_grad_(True)
        table = table_of(seq, rot, dtype)
        reference = split_and_rotate(mixed, table, per_group)
        fused = rotate_qkv(mixed.detach(), table, per_group)
        upstream = [torch.randn(t.shape, generator=gen).to(dtype) for t in reference]
        # the query gradient strided as SDPA's backward leaves it ([b, n, s, d] memory)
        upstream[0] = upstream[0].permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3)
        expected = torch.autograd.grad(reference, mixed, upstream)[0]
        grad = rotate_qkv_backward(*upstream, table, per_group)
        assert all(t.is_contiguous() for t in (*fused, grad))
        pairs = [*zip(fused, reference), (grad, expected)]
        if dtype == torch.bfloat16:  # the interpreter truncates to bf16 (the GPU rounds)
            for got, want in pairs:
                torch.testing.assert_close(got, want.detach(), atol=0.07, rtol=2 ** -7)
        else:
            assert all(torch.equal(got, want) for got, want in pairs), (seq, head_dim, dtype)
        key_start = per_group * head_dim  # the key was rotated, the value copied
        assert not torch.equal(fused[1][..., :rot], mixed.detach()[..., key_start:][..., :rot])
        assert torch.equal(fused[2], mixed.detach()[..., key_start + head_dim:])

# the custom op, eager and traced with dynamic shapes (the compiled layers' use), with autograd
def combined(q, k, v):  # every output in a differentiable result
    return q.sum(-1) * 2 + k.sum(-1).repeat_interleave(2, -1) + v.sum(-1).repeat_interleave(2, -1)

def through_op(mixed, table):
    return combined(*torch.ops.rl_megatron.qkv_rotary(mixed, table, 2))

traced = torch.compile(through_op, backend="aot_eager", dynamic=True, fullgraph=True)
for seq in (9, 17):
    mixed = torch.randn(seq, 2, 2, 4 * 16, generator=gen).half().requires_grad_(True)
    table = table_of(seq, 16, torch.float16)
    want = combined(*split_and_rotate(mixed, table, 2))
    (want_grad,) = torch.autograd.grad(want.sum(), mixed)
    for run in (through_op, traced):
        got = run(mixed, table)
        assert torch.equal(got, want)
        assert torch.equal(torch.autograd.grad(got.sum(), mixed)[0], want_grad)
print("rotated")
"""


def test_kernels_equal_split_and_table_rotary_in_the_interpreter():
    """The forward and backward kernels (run on CPU by Triton's interpreter, in a fresh
    interpreter since the variable is read when the kernels are defined) give megatron's
    split and the table rotary: to the bit in fp16 and fp32 (bf16 within the interpreter's
    truncating casts; the GPU test checks bf16 to the bit), contiguous, for GQA, partial
    rope and a head dim that is not a power of two; the custom op traces with dynamic
    shapes and no graph break and has the same gradient."""
    pytest.importorskip("triton")
    env = os.environ | {"TRITON_INTERPRET": "1"}
    script = f"SHAPES = {SHAPES!r}\n{KERNEL_CHECK}"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "rotated" in done.stdout, done.stderr[-3000:]


MODEL_CHECK = """
import os, sys
import torch, torch.distributed as dist
import tiny
from rl_core.distributed import free_port
from rl_core.objective import Objective
from rl_megatron import qkv_rotary
from rl_megatron.backend import MegatronBackend
from rl_megatron.config import MegatronConfig
from rl_megatron.parallel import initialize_parallel
from rl_megatron.testing import cpu_shim

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
cpu_shim.install()
dist.init_process_group("gloo", rank=0, world_size=1)
initialize_parallel(tp=1, device="cpu")
qkv_rotary.kernel_serves = lambda mixed: True  # the kernels on CPU tensors (interpreter)
from rl_megatron import _triton_qkv_rotary as kernels
launched = []
for name in ("rotate_qkv", "rotate_qkv_backward"):
    def counted(*args, _launch=getattr(kernels, name), _name=name):
        launched.append(_name)
        return _launch(*args)
    setattr(kernels, name, counted)
batch = tiny.random_batch([9, 14, 6, 11], seed=5)
for compiled in (False, True):  # eager layers, then inductor's (the op called from the graph)
    results = {}
    for fused in (False, True):
        config = MegatronConfig(hf_path=sys.argv[1], device="cpu", lr=1e-3,
                                objective=Objective(entropy_coef=0.01), fused_qkv_rotary=fused,
                                compile_layers=compiled)
        backend = MegatronBackend(config)
        results[fused] = (backend.compute_log_probs(batch), backend.forward_backward(batch),
                          backend.hf_gradients())
    (lp0, m0, g0), (lp1, m1, g1) = results[False], results[True]
    assert torch.equal(lp0, lp1) and m0["loss/total"] == m1["loss/total"]
    assert g0.keys() == g1.keys() and all(torch.equal(g1[k], g) for k, g in g0.items())
    assert any("q_proj" in k for k in g0)
    # two layers: log-probs and forward_backward forward, one backward
    assert launched.count("rotate_qkv") == 4 and launched.count("rotate_qkv_backward") == 2
    launched.clear()
from rl_core.compiling import compile_report
report = compile_report()
assert report["graph_breaks"] == 0 and not report["failures"], report
print("model equal")
"""


def test_kernels_in_the_model_equal_the_split_path(tmp_path):
    """The backend with the fused rotary's kernels and custom op (forced onto CPU tensors,
    run by Triton's interpreter, float32) gives the split path's log-probs, loss and
    gradients to the bit, with eager layers and with inductor-compiled ones (the op called
    from the graph, no graph break): megatron's fused path, the op's autograd and the
    gradients as SDPA hands them back."""
    pytest.importorskip("triton")
    tiny.save_tiny_model(tmp_path / "qwen2", "qwen2", seed=2)
    env = os.environ | {"TRITON_INTERPRET": "1", "PYTHONPATH": _tests_path()}
    done = subprocess.run(
        [sys.executable, "-c", MODEL_CHECK, str(tmp_path / "qwen2")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and "model equal" in done.stdout, done.stderr[-3000:]


def _tests_path() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["qwen2-tied", "llama"])
def test_backend_with_fused_qkv_rotary_equals_megatron_split(
    world1, model_dirs, name, precision, monkeypatch
):
    """The backend through megatron's fused q/k/v rope path gives the split path's
    log-probs, loss and gradients to the bit (on CPU both run the same torch ops), and the
    fused path is the one taken."""
    from rl_megatron import qkv_rotary

    calls = _count_calls(monkeypatch, qkv_rotary, ("rotate_qkv",))
    split = _run(model_dirs, name, precision=precision, fused_qkv_rotary=False)
    assert not calls
    fused = _run(model_dirs, name, precision=precision, fused_qkv_rotary=True)
    assert len(calls) == 2 * 2  # two layers, log-probs and forward_backward
    _assert_same(fused, split, atol=0)
    assert all(torch.equal(fused[2][key], grad) for key, grad in split[2].items())


def test_fused_qkv_rotary_only_where_megatron_fuses(world1, model_dirs):
    """q/k norms (Qwen3) and MLA keep megatron's split; so does a model without the
    table; ``fused_single_qkv_rope`` is this config's, refused in ``megatron``."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    def fused(name, **overrides):
        config = MegatronConfig(hf_path=model_dirs[name][0], device="cpu", **overrides)
        return MegatronBackend(config).model.config.fused_single_qkv_rope

    assert fused("llama", fused_qkv_rotary=True)
    assert not fused("llama", fused_qkv_rotary=True, rotary_table=False)
    assert not fused("qwen3", fused_qkv_rotary=True)
    assert not fused("deepseek_v3", fused_qkv_rotary=True)
    assert fused("llama")  # on by default
    assert not fused("llama", fused_qkv_rotary=False)
    with pytest.raises(ValueError, match="fused_qkv_rotary"):
        MegatronConfig(
            hf_path=model_dirs["llama"][0], device="cpu", megatron={"fused_single_qkv_rope": True}
        )


def _cuda_table(seq: int, rot: int) -> torch.Tensor:
    from rl_megatron.rotary import cos_sin_table

    inv_freq = 1.0 / 1e6 ** (torch.arange(0, rot, 2, device="cuda").float() / rot)
    freqs = torch.outer(torch.arange(seq, device="cuda").float(), inv_freq)
    return cos_sin_table(torch.cat([freqs, freqs], -1)[:, None, None, :], torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(2048, 4, 2, 6, 128, 128), *SHAPES])  # 1.5B's layers first
def test_kernels_on_cuda_equal_split_and_table_rotary(shape):
    """On CUDA in bf16 the op (kernels forward and backward, eager and compiled by
    inductor with dynamic shapes) equals megatron's split and the table rotary to the bit."""
    from rl_megatron.qkv_rotary import rotate_qkv, split_and_rotate

    seq, batch, groups, per_group, head_dim, rot = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    width = (per_group + 2) * head_dim
    mixed = torch.randn(seq, batch, groups, width, device="cuda", generator=gen) * 3
    mixed = mixed.bfloat16().requires_grad_(True)
    table = _cuda_table(seq, rot)
    reference = split_and_rotate(mixed, table, per_group)
    upstream = [torch.randn(t.shape, device="cuda", generator=gen).bfloat16() for t in reference]
    upstream[0] = upstream[0].permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3)
    expected = torch.autograd.grad(reference, mixed, upstream)[0]
    compiled = torch.compile(rotate_qkv, dynamic=True, fullgraph=True)
    for rotate in (rotate_qkv, compiled):
        fused = rotate(mixed, table, per_group)
        assert all(torch.equal(got, want) for got, want in zip(fused, reference, strict=True))
        assert torch.equal(torch.autograd.grad(fused, mixed, upstream)[0], expected)


def _fused_job(rank: int, port: int, hf_path: str, out_path: str) -> None:
    """bf16 compiled backend with and without the fused rotary on one GPU (spawned: no
    CPU shim); log-probs, three steps' losses and what torch.compile did."""
    import torch.distributed as dist
    from gpu_job import _steps

    from rl_core.compiling import compile_report

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    result = {}
    for fused in (True, False):
        backend, result[fused] = _steps(hf_path, fused_qkv_rotary=fused)
        result[fused]["applied"] = backend.model.config.fused_single_qkv_rope
        result[fused]["compile"] = compile_report()
    torch.save(result, out_path)
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_layers_with_fused_qkv_rotary(tmp_path):
    """The compiled bf16 layers of a GQA model with the fused rotary: no graph break, no
    fallback, and log-probs and losses as without it (the compiled split path keeps float32
    between the rotary's multiply and add, the kernel rounds as eager: a last-bit
    difference, as between compiled and eager layers)."""
    directory = tmp_path / "qwen2"
    hf_model = tiny.save_tiny_model(directory, "qwen2", seed=4)
    out = tmp_path / "out.pt"
    args = (free_port(), str(directory), str(out))
    mp.start_processes(_fused_job, args=args, nprocs=1, start_method="spawn")
    result = torch.load(out, weights_only=False)
    fused, split = result[True], result[False]
    assert fused["applied"] and not split["applied"]
    assert fused["compile"]["graph_breaks"] == 0, fused["compile"]["break_reasons"]
    assert not fused["compile"]["failures"]
    diff = (fused["log_probs"] - split["log_probs"]).abs()
    assert float(diff.mean()) < 5e-3 and float(diff.max()) < 0.05, (diff.mean(), diff.max())
    for got, expected in zip(fused["losses"], split["losses"], strict=True):
        assert got == pytest.approx(expected, rel=1e-2, abs=1e-2)
    batch = tiny.random_batch(GPU_LENGTHS, seed=21)  # the batch of gpu_job._steps
    expected = tiny.hf_log_probs(hf_model, batch).detach()
    mask = batch.loss_mask.bool()
    assert float((fused["log_probs"][mask] - expected[mask]).abs().mean()) < 0.02
