"""Fused Triton kernels for log-probs and entropy on CUDA (one pass over the logits).

Each program owns one row (token) and streams its vocabulary in blocks with an online
softmax, so the logits are read once in their own dtype and nothing of size [N, V] is
written in the forward pass; the backward pass reads them once more and writes the
gradient. The torch path in :mod:`rl_core.logprobs` is the reference these are tested
against (tests marked ``gpu``).
"""

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _forward_kernel(
    logits_ptr,
    row_stride,
    tokens_ptr,
    log_probs_ptr,
    entropy_ptr,
    lse_ptr,
    mean_z_ptr,
    vocab,
    inv_temperature,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    running_max = tl.full((), float("-inf"), tl.float32)
    sum_exp = tl.full((), 0.0, tl.float32)
    sum_exp_z = tl.full((), 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        valid = offsets < vocab
        z = tl.load(base + offsets, mask=valid, other=float("-inf")).to(tl.float32)
        z = z * inv_temperature
        new_max = tl.maximum(running_max, tl.max(z, 0))
        rescale = tl.exp(running_max - new_max)
        e = tl.where(valid, tl.exp(z - new_max), 0.0)
        sum_exp = sum_exp * rescale + tl.sum(e, 0)
        sum_exp_z = sum_exp_z * rescale + tl.sum(tl.where(valid, e * z, 0.0), 0)
        running_max = new_max
    lse = running_max + tl.log(sum_exp)
    mean_z = sum_exp_z / sum_exp
    token = tl.load(tokens_ptr + row)
    z_token = tl.load(base + token).to(tl.float32) * inv_temperature
    tl.store(log_probs_ptr + row, z_token - lse)
    tl.store(entropy_ptr + row, lse - mean_z)
    tl.store(lse_ptr + row, lse)
    tl.store(mean_z_ptr + row, mean_z)


@triton.jit
def _backward_kernel(
    logits_ptr,
    row_stride,
    grad_ptr,
    tokens_ptr,
    lse_ptr,
    mean_z_ptr,
    grad_lp_ptr,
    grad_ent_ptr,
    vocab,
    inv_temperature,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    out = grad_ptr + row * vocab
    lse = tl.load(lse_ptr + row)
    mean_z = tl.load(mean_z_ptr + row)
    g_lp = tl.load(grad_lp_ptr + row)
    g_ent = tl.load(grad_ent_ptr + row)
    token = tl.load(tokens_ptr + row)
    for start in range(0, vocab, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        valid = offsets < vocab
        z = tl.load(base + offsets, mask=valid, other=0.0).to(tl.float32) * inv_temperature
        p = tl.exp(z - lse)
        grad = -p * (g_lp + g_ent * (z - mean_z))
        grad = tl.where(offsets == token, grad + g_lp, grad) * inv_temperature
        tl.store(out + offsets, grad.to(grad_ptr.dtype.element_ty), mask=valid)


class TritonLogProbEntropy(torch.autograd.Function):
    """Same contract as the torch path: ``[N, V]`` logits, ``[N]`` tokens -> two ``[N]``."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature):
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        num_rows, vocab = logits.shape
        outputs = torch.empty(4, num_rows, dtype=torch.float32, device=logits.device)
        log_probs, entropy, lse, mean_z = outputs.unbind(0)
        if num_rows:
            _forward_kernel[(num_rows,)](
                logits,
                logits.stride(0),
                tokens,
                log_probs,
                entropy,
                lse,
                mean_z,
                vocab,
                1.0 / temperature,
                BLOCK=_BLOCK,
                num_warps=8,
            )
        ctx.save_for_backward(logits, tokens, lse, mean_z)
        ctx.temperature = temperature
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, tokens, lse, mean_z = ctx.saved_tensors
        num_rows, vocab = logits.shape
        grad_logits = torch.empty(num_rows, vocab, dtype=logits.dtype, device=logits.device)
        zeros = torch.zeros(num_rows, dtype=torch.float32, device=logits.device)
        grad_lp = zeros if grad_log_probs is None else grad_log_probs.float().contiguous()
        grad_ent = zeros if grad_entropy is None else grad_entropy.float().contiguous()
        if num_rows:
            _backward_kernel[(num_rows,)](
                logits,
                logits.stride(0),
                grad_logits,
                tokens,
                lse,
                mean_z,
                grad_lp,
                grad_ent,
                vocab,
                1.0 / ctx.temperature,
                BLOCK=_BLOCK,
                num_warps=8,
            )
        return grad_logits, None, None
