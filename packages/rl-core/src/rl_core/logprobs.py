"""Log-probs of sampled tokens and entropy from logits, chunked over tokens.

The plain way, ``log_softmax(logits.float())``, materialises a float32 ``[tokens, vocab]``
tensor (8192 × 151,936 × 4 bytes = 5 GB) plus its copies for the backward pass. Here the
tokens are processed ``chunk_size`` rows at a time, forward and backward (the backward
recomputes each chunk's softmax), so only one chunk's float32 softmax exists at a time.
The results equal the plain computation; gradients flow into ``logits``.

Shapes: ``logits`` ``[..., V]`` (any float dtype), ``tokens`` ``[...]`` int; outputs are
float32 of shape ``[...]`` (float64 for float64 logits). Temperature divides the logits first, as the engines do.
"""

import importlib.util

import torch

DEFAULT_CHUNK_SIZE = 1024


def log_probs_from_logits(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """log softmax(logits / temperature)[tokens]: ``[..., V]``, ``[...]`` -> ``[...]`` float32.

    ``chunk_size=None`` uses ``DEFAULT_CHUNK_SIZE`` rows per chunk.
    """
    log_probs, _ = log_probs_and_entropy(
        logits, tokens, temperature=temperature, chunk_size=chunk_size, with_entropy=False
    )
    return log_probs


def entropy_from_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: ``[..., V]`` -> ``[...]``."""
    _, entropy = log_probs_and_entropy(
        logits, None, temperature=temperature, chunk_size=chunk_size, with_log_probs=False
    )
    return entropy


def log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor | None,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_log_probs: bool = True,
    with_entropy: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Both in one pass over the logits (one softmax per chunk). Returns ``(log_probs, entropy)``,
    each ``[...]`` float32 or None when not asked for.

    ``backend``: ``"torch"`` (chunked, any device), ``"triton"`` (fused kernels, CUDA, half
    or float32 logits) or ``"auto"`` (triton when the logits are on CUDA and triton imports).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch_shape = logits.shape[:-1]
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if with_log_probs:
        if tokens is None or tokens.shape != batch_shape:
            raise ValueError(
                f"tokens must have shape {tuple(batch_shape)} to match logits "
                f"{tuple(logits.shape)}, got {None if tokens is None else tuple(tokens.shape)}"
            )
        flat_tokens = tokens.reshape(-1).long()
    else:
        flat_tokens = flat_logits.new_zeros(flat_logits.shape[0], dtype=torch.long)
    if _use_triton(backend, flat_logits):
        from rl_core._triton_logprobs import TritonLogProbEntropy

        log_probs, entropy = TritonLogProbEntropy.apply(
            flat_logits, flat_tokens, float(temperature)
        )
    else:
        log_probs, entropy = _ChunkedLogProbEntropy.apply(
            flat_logits, flat_tokens, float(temperature), int(chunk_size), with_entropy
        )
    log_probs = log_probs.view(batch_shape) if with_log_probs else None
    entropy = entropy.view(batch_shape) if with_entropy else None
    return log_probs, entropy


LOGPROB_BACKENDS = ("auto", "torch", "triton")


def _use_triton(backend: str, logits: torch.Tensor) -> bool:
    if backend not in LOGPROB_BACKENDS:
        raise ValueError(
            f"unknown backend {backend!r}; choose one of: {', '.join(LOGPROB_BACKENDS)}"
        )
    fused_ok = logits.is_cuda and logits.dtype != torch.float64
    if backend == "triton":
        if not fused_ok:
            raise ValueError("backend='triton' needs CUDA logits in float32/bfloat16/float16")
        return True
    if backend == "torch" or not fused_ok:
        return False
    return importlib.util.find_spec("triton") is not None


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision logits, the input's dtype when wider (float64 for checks)."""
    return torch.promote_types(dtype, torch.float32)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot product ``[rows, V] x [rows, V] -> [rows, 1]`` without a [rows, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).squeeze(-1)


def _shifted_softmax_parts(logits_chunk: torch.Tensor, temperature: float):
    """For z = logits / T: (z - max z, exp(z - max z), log of the row sums of that exp).

    Two [rows, V] buffers in the maths dtype; every later step works in place on them.
    """
    shifted = logits_chunk.to(_math_dtype(logits_chunk.dtype), copy=True)
    if temperature != 1.0:
        shifted.div_(temperature)
    shifted.sub_(shifted.amax(dim=-1, keepdim=True))
    exp_shifted = shifted.exp()
    log_sum = exp_shifted.sum(dim=-1, keepdim=True).log_()
    return shifted, exp_shifted, log_sum


class _ChunkedLogProbEntropy(torch.autograd.Function):
    """Forward and backward over row chunks; nothing of size [N, V] is saved but the input.

    With z = logits / T, p = softmax(z), H = lse(z) - sum(p·z) (all invariant to shifting z):
      d logp_y / d z = onehot(y) - p,   d H / d z = -p · (z - sum(p·z)),   d z / d logits = 1 / T.
    """

    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk_size, with_entropy):
        num_rows = logits.shape[0]
        out_dtype = _math_dtype(logits.dtype)
        log_probs = torch.empty(num_rows, dtype=out_dtype, device=logits.device)
        entropy = torch.zeros(num_rows, dtype=out_dtype, device=logits.device)
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            shifted, exp_shifted, log_sum = _shifted_softmax_parts(logits[rows], temperature)
            picked = shifted.gather(-1, tokens[rows].unsqueeze(-1))
            log_probs[rows] = (picked - log_sum).squeeze(-1)
            if with_entropy:
                mean_shifted = _row_dot(exp_shifted, shifted) / log_sum.exp()
                entropy[rows] = (log_sum - mean_shifted).squeeze(-1)
            del shifted, exp_shifted  # free this chunk before the next one allocates
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        ctx.save_for_backward(logits, tokens)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, tokens = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            grad = _chunk_grad(
                logits[rows],
                tokens[rows],
                None if grad_log_probs is None else grad_log_probs[rows].unsqueeze(-1),
                None if grad_entropy is None else grad_entropy[rows].unsqueeze(-1),
                ctx.temperature,
            )
            grad_logits[rows] = grad
            del grad  # free this chunk before the next one allocates
        return grad_logits, None, None, None, None


def _chunk_grad(logits_chunk, tokens_chunk, grad_lp, grad_ent, temperature):
    """d(loss)/d(logits) of one chunk: -p·(g_lp + g_ent·(z - E_p[z])) + g_lp·onehot, over T."""
    shifted, probs, log_sum = _shifted_softmax_parts(logits_chunk, temperature)
    probs.div_(log_sum.exp())
    if grad_ent is not None:
        grad = shifted.sub_(_row_dot(probs, shifted)).mul_(grad_ent)  # reuses the z buffer
        if grad_lp is not None:
            grad.add_(grad_lp)
        grad.mul_(probs).neg_()
    else:
        grad = probs.mul_(-grad_lp) if grad_lp is not None else probs.zero_()
    if grad_lp is not None:
        grad.scatter_add_(-1, tokens_chunk.unsqueeze(-1), grad_lp)
    if temperature != 1.0:
        grad.div_(temperature)
    return grad
