"""CPU kernels for torch's varlen attention ops (``torch_attn::_varlen_attn`` and its
backward, CUDA-only), with the same maths: the real ``varlen_attn``, its custom op,
autograd and fake tensors then run on CPU, traced whole in compiled layers (the CUDA
default ``torch_varlen``'s graph, checked on CPU)."""

import functools

import torch


def _per_sequence(query, key, value, cu_seq, scale, grad_out=None):
    """Causal attention of each sequence of ``cu_seq`` alone, ``[T, H, D]`` (key/value
    heads repeated for GQA): what torch's varlen kernel computes. With ``grad_out``, the
    gradients of query, key and value instead (by hand: a kernel runs below autograd)."""
    repeat = query.shape[1] // key.shape[1]
    scale = scale or query.shape[-1] ** -0.5
    lengths = (cu_seq[1:] - cu_seq[:-1]).tolist()
    split = [t.transpose(0, 1).split(lengths, dim=1) for t in (query, key, value)]
    grads = [grad_out.transpose(0, 1).split(lengths, dim=1)] if grad_out is not None else []
    outs = [[], [], []]
    for q, k, v, *g in zip(*split, *grads, strict=True):
        k, v = k.repeat_interleave(repeat, dim=0), v.repeat_interleave(repeat, dim=0)
        causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
        probs = (q @ k.transpose(1, 2) * scale).masked_fill(~causal, float("-inf")).softmax(-1)
        if not g:
            outs[0].append(probs @ v)
            continue
        out, d_out = probs @ v, g[0]
        d_scores = probs * (d_out @ v.transpose(1, 2) - (d_out * out).sum(-1, keepdim=True))
        d_k, d_v = d_scores.transpose(1, 2) @ q * scale, probs.transpose(1, 2) @ d_out
        outs[0].append(d_scores @ k * scale)
        outs[1].append(d_k.unflatten(0, (-1, repeat)).sum(1))
        outs[2].append(d_v.unflatten(0, (-1, repeat)).sum(1))
    return [torch.cat(o, dim=1).transpose(0, 1).contiguous() for o in outs if o]


def _cpu_forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale, *_):
    assert causal
    (out,) = _per_sequence(query, key, value, cu_seq_q, scale)
    lse = torch.zeros(query.shape[1], query.shape[0])  # unused by the CPU backward below
    return out, lse, torch.zeros(2, dtype=torch.uint64)


def _cpu_backward(
    grad_out, query, key, value, out, lse, cu_q, cu_k, max_q, max_k, causal, rng, scale=None, *_
):
    return tuple(_per_sequence(query, key, value, cu_q, scale, grad_out))


@functools.cache
def register_cpu_kernels() -> None:
    """CPU kernels for torch's varlen custom ops (CUDA-only), with the same maths: the
    real ``varlen_attn``, its op, autograd and fake tensors run on CPU, traced."""
    import torch.nn.attention.varlen

    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", _cpu_forward)
    torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", _cpu_backward)
