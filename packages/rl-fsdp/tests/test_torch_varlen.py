"""torch_varlen on CPU: the call adapted to each torch release's ``varlen_attn`` signature
(the locked torch's real one, 2.10's and 2.11's), what "auto" picks and refuses, and the
glue (layouts, GQA, scaling) through a CPU stand-in for the CUDA-only kernel with the same
maths, equal to one SDPA per sequence in the model, eager and inside compiled attention
modules. The kernel itself is checked against SDPA in test_fsdp_gpu.py."""

import copy
import functools
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from fsdp_tiny import CONFIGS, plain_model, tokens_batch
from varlen_cpu import register_cpu_kernels

from rl_fsdp import fusion, torch_varlen
from rl_fsdp.attention import auto_attention, register_packed_attention, resolve_attention
from rl_fsdp.config import FSDPConfig
from rl_fsdp.forward import packed_forward
from rl_fsdp.torch_varlen import CallPlan, call_kwargs, plan_from_signature

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _cpu_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale=None, enable_gqa=False):
    """What the kernel computes, ``[T, H, D]`` in and out, with its argument checks."""
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError("Expect query and key/value to have the same number of heads")
    assert cu_q is cu_k and isinstance(max_q, int) and max_q == max_k
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    assert max_q == max(lengths)
    parts = zip(*(t.transpose(0, 1).split(lengths, dim=1) for t in (q, k, v)), strict=True)
    outs = [
        F.scaled_dot_product_attention(
            a, b, c, is_causal=causal, scale=scale, enable_gqa=enable_gqa
        )
        for a, b, c in parts
    ]
    return torch.cat(outs, dim=1).transpose(0, 1)


def varlen_2_10(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None
):
    return _cpu_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal)


def varlen_2_11(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
):
    causal = list(window_size) == [-1, 0]
    return _cpu_varlen(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=causal, scale=scale
    )


@functools.wraps(torch_varlen.varlen_function())  # the locked torch's real signature
def varlen_locked(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
    causal = list(kwargs.get("window_size", (-1, -1))) == [-1, 0]
    return _cpu_varlen(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        causal=causal,
        scale=kwargs.get("scale"),
        enable_gqa=kwargs.get("enable_gqa", False),
    )


def test_plans_for_each_signature():
    real = inspect.signature(torch_varlen.varlen_function())
    assert plan_from_signature(real) == CallPlan(("window_size", (-1, 0)), True, True)
    old = plan_from_signature(inspect.signature(varlen_2_10))
    assert old == CallPlan(("is_causal", True), False, False)
    mid = plan_from_signature(inspect.signature(varlen_2_11))
    assert mid == CallPlan(("window_size", (-1, 0)), True, False)
    with pytest.raises(RuntimeError, match="neither window_size nor is_causal"):
        plan_from_signature(inspect.signature(lambda q, k, v, cu_q, cu_k, mq, mk: None))


def test_call_kwargs_scaling_and_gqa():
    old, new = (
        CallPlan(("is_causal", True), False, False),
        CallPlan(("window_size", (-1, 0)), True, True),
    )
    qwen = {"head_dim": 128, "heads": 12, "kv_heads": 2}  # Qwen2.5 1.5B
    assert call_kwargs(old, scaling=128**-0.5, **qwen) == ({"is_causal": True}, 6)
    assert call_kwargs(old, scaling=None, **qwen) == ({"is_causal": True}, 6)
    with pytest.raises(ValueError, match="takes no scale"):
        call_kwargs(old, scaling=0.5, **qwen)
    kwargs, repeat = call_kwargs(new, scaling=0.5, **qwen)
    assert kwargs == {"window_size": (-1, 0), "scale": 0.5, "enable_gqa": True} and repeat == 1
    same_heads = call_kwargs(new, scaling=None, head_dim=64, heads=4, kv_heads=4)
    assert same_heads == ({"window_size": (-1, 0), "scale": None}, 1)
    with pytest.raises(ValueError, match="not a multiple"):
        call_kwargs(new, scaling=None, head_dim=64, heads=12, kv_heads=5)


def test_auto_and_explicit_choices():
    def never():
        raise AssertionError("probed where it is not the candidate")

    assert auto_attention("cpu", "bf16", flash_attn=True, torch_varlen=never) == "sdpa_grouped"
    assert auto_attention("cuda", "bf16", flash_attn=True, torch_varlen=never) == "flash_varlen"
    assert auto_attention("cuda", "fp32", flash_attn=False, torch_varlen=never) == "sdpa_grouped"
    assert auto_attention("cuda", "bf16", flash_attn=False, torch_varlen=lambda: True) == (
        "torch_varlen"
    )
    assert auto_attention("cuda", "bf16", flash_attn=False, torch_varlen=lambda: False) == (
        "sdpa_grouped"
    )
    assert resolve_attention("auto", CPU, "bf16") == "sdpa_grouped"
    for device, precision in ((CPU, "bf16"), (CUDA, "fp32")):
        with pytest.raises(ValueError, match="needs device='cuda' and precision='bf16'"):
            resolve_attention("torch_varlen", device, precision)
    assert FSDPConfig(model_config=CONFIGS["qwen2"], attention="torch_varlen").attention


def test_probe_refuses_a_kernel_that_fails_or_is_wrong(monkeypatch):
    def cuda_only(*args, **kwargs):  # as the real kernel on CPU, unless a test gave it one
        raise NotImplementedError("no CPU kernel for torch_attn::_varlen_attn")

    monkeypatch.setattr(torch_varlen, "varlen_function", lambda: cuda_only)
    error = torch_varlen.probe(CPU)
    assert error and "probe failed" in error and error in torch_varlen.PROBE_ERRORS
    monkeypatch.undo()
    assert torch_varlen._probe(varlen_2_11, CPU) is None  # right maths, bf16

    def not_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1)):
        return _cpu_varlen(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=False, enable_gqa=True
        )

    assert "off by" in torch_varlen._probe(not_causal, CPU)


def _logits_and_grads(model, batch, impl):
    model.zero_grad()
    logits = packed_forward(model, batch.tokens, batch.cu_seqlens, impl)
    (logits * logits.detach().sign()).sum().backward()
    return logits, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("fn", [varlen_2_10, varlen_2_11, varlen_locked])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_torch_varlen_equals_per_sequence_sdpa_in_the_model(fn, family, monkeypatch):
    """Packed logits and gradients (GQA: 4 query heads, 2 key/value heads) equal
    ``sdpa_per_doc``'s, eager and in compiled attention modules (graph break around it)."""
    monkeypatch.setattr(torch_varlen, "varlen_function", lambda: fn)
    model = plain_model(CONFIGS[family])
    model.config._attn_implementation = register_packed_attention()
    compiled = copy.deepcopy(model)
    fusion.compile_blocks(compiled, backend="aot_eager")
    for lengths in ([9, 17, 5], [30, 1, 2], [50]):
        batch = tokens_batch(lengths=lengths)
        want, want_grads = _logits_and_grads(model, batch, "sdpa_per_doc")
        for net in (model, compiled):
            got, grads = _logits_and_grads(net, batch, "torch_varlen")
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            for a, b in zip(grads, want_grads, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert fusion.compiled_count(compiled)[1] == 0


def test_model_scaling_reaches_the_kernel(monkeypatch):
    """A scaling other than 1/sqrt(D) is passed where the kernel takes one and refused
    where it does not (the result would be silently wrong)."""
    q, k, v = (torch.randn(1, 4, 12, 16, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    got = torch_varlen.varlen_attention(q, k, v, cu, 7, 0.3, 0.0, fn=varlen_2_11)
    repeat = (t.repeat_interleave(2, dim=1) for t in (k, v))
    want = torch.cat(
        [
            F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=0.3)
            for a, b, c in zip(*(t.split([5, 7], dim=2) for t in (q, *repeat)), strict=True)
        ],
        dim=2,
    ).transpose(1, 2)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="takes no scale"):
        torch_varlen.varlen_attention(q, k, v, cu, 7, 0.3, 0.0, fn=varlen_2_10)
    default = torch_varlen.varlen_attention(q, k, v, cu, 7, 1 / math.sqrt(16), 0.0, fn=varlen_2_10)
    assert default.shape == (1, 12, 4, 16)
    with pytest.raises(ValueError, match="no dropout"):
        torch_varlen.varlen_attention(q, k, v, cu, 7, None, 0.1, fn=varlen_2_11)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_real_varlen_op_is_traced_whole_in_compiled_layers(family):
    """torch's own ``varlen_attn`` (its custom op, autograd and fake implementation; CPU
    kernels stand in for CUDA's) inside compiled decoder layers: no graph break, one graph
    per layout kind (equal lengths take batched SDPA), each recompiled once when the
    longest sequence changes, plus the final norm; logits and gradients equal
    ``sdpa_per_doc``'s in the eager model over five layouts."""
    from torch._dynamo.utils import counters

    register_cpu_kernels()
    model = plain_model(CONFIGS[family])
    model.config._attn_implementation = register_packed_attention()
    compiled = copy.deepcopy(model)
    fusion.compile_blocks(compiled, backend="aot_eager")
    torch._dynamo.reset()  # count this test's graphs only (code is cached per code object)
    counters.clear()
    for lengths in ([9, 17, 5], [30, 1, 2], [12, 12, 12, 4], [16, 16, 16], [50]):
        batch = tokens_batch(lengths=lengths)
        want, want_grads = _logits_and_grads(model, batch, "sdpa_per_doc")
        got, grads = _logits_and_grads(compiled, batch, "torch_varlen")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] <= 5
    assert fusion.compiled_count(compiled) == (CONFIGS[family]["num_hidden_layers"] + 1, 0)
