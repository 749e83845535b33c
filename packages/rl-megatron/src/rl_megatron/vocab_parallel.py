"""Log-probs and entropy from vocabulary-parallel logits (each TP rank holds V/tp columns).

The softmax is never gathered: per row, ranks all-reduce the max, the sum of exp and the
target logit, so every rank ends with the full-vocabulary results. Rows are processed
``chunk_size`` at a time forward and backward (as :mod:`rl_core.logprobs` does); the
backward needs no communication because the per-row logsumexp and mean logit are saved.

Shapes: ``logits`` ``[N, V_local]`` (any float dtype), ``targets`` ``[N]`` int64 global ids;
outputs ``[N]`` float32. Columns at global ids ``>= vocab_size`` (Megatron's vocabulary
padding) are excluded from the softmax.
"""

import torch
import torch.distributed as dist

DEFAULT_CHUNK_SIZE = 1024


def vocab_parallel_log_probs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    tp_group=None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_probs [N], entropy [N] or None)`` of softmax(logits / temperature) over the
    whole (unpadded) vocabulary; differentiable in ``logits``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    log_probs, entropy = _VocabParallelLogProbs.apply(
        logits, targets.long(), vocab_size, tp_group, float(temperature), int(chunk_size)
    )
    return log_probs, (entropy if with_entropy else None)


def _rank_and_world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(tensor: torch.Tensor, op, group) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelLogProbs(torch.autograd.Function):
    """z = logits / T (padding columns at -inf), p = softmax(z) over all ranks' columns:
    logp_y = z_y - lse,  H = lse - Σ p·z;  d logp_y/dz = onehot(y) - p,
    dH/dz = -p · (z - Σ p·z);  d/d logits = (d/dz) / T."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_size, group, temperature, chunk_size):
        rank, _ = _rank_and_world(group)
        start = rank * logits.shape[1]
        num_rows = logits.shape[0]
        log_probs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(log_probs)
        mean_z = torch.empty_like(log_probs)
        for first in range(0, num_rows, chunk_size):
            rows = slice(first, first + chunk_size)
            z = _scaled(logits[rows], start, vocab_size, temperature)
            lse[rows], mean_z[rows], log_probs[rows] = _chunk_stats(z, targets[rows], start, group)
        ctx.save_for_backward(logits, targets, lse, mean_z)
        ctx.args = (vocab_size, start, temperature, chunk_size)
        ctx.set_materialize_grads(False)
        return log_probs, lse - mean_z

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, targets, lse, mean_z = ctx.saved_tensors
        vocab_size, start, temperature, chunk_size = ctx.args
        grad_logits = torch.empty_like(logits)
        for first in range(0, logits.shape[0], chunk_size):
            rows = slice(first, first + chunk_size)
            z = _scaled(logits[rows], start, vocab_size, temperature)
            probs = torch.sub(z, lse[rows, None]).exp_()
            # d/dz = p · (-g_lp - g_ent · (z - Σp·z)) + g_lp · onehot(y); in place on z
            if grad_entropy is None:
                coeff = -grad_log_probs[rows, None]
            else:
                coeff = _centred(z, mean_z[rows, None]).mul_(-grad_entropy[rows, None])
                if grad_log_probs is not None:
                    coeff.sub_(grad_log_probs[rows, None])
            grad = probs.mul_(coeff)
            if grad_log_probs is not None:  # + g_lp at the target column (no host sync)
                column, hit = _local_targets(targets[rows], start, z.shape[1])
                grad.scatter_add_(1, column[:, None], (grad_log_probs[rows] * hit)[:, None])
            if temperature != 1.0:
                grad.div_(temperature)
            grad_logits[rows] = grad
        return grad_logits, None, None, None, None, None


def _centred(z: torch.Tensor, mean_z: torch.Tensor) -> torch.Tensor:
    """``z - Σp·z`` in place, 0 at the -inf padding columns (their probability is 0)."""
    return z.sub_(mean_z).nan_to_num_(neginf=0.0)


def _scaled(logits_chunk, start: int, vocab_size: int, temperature: float) -> torch.Tensor:
    """A new float32 copy of the chunk divided by T, vocabulary-padding columns at -inf
    (the caller may modify it in place)."""
    z = logits_chunk.to(torch.float32, copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    num_real = max(0, min(z.shape[1], vocab_size - start))
    if num_real < z.shape[1]:
        z[:, num_real:] = float("-inf")
    return z


def _local_targets(targets, start: int, width: int):
    """(column of each target in this rank's slice, clamped, ``[rows]``; 1.0 where the
    target is in this slice, else 0.0)."""
    local = targets - start
    hit = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), hit.float()


def _chunk_stats(z, targets, start: int, group):
    """Global (lse, Σ p·z, log p_target) of a chunk's rows, ``[rows]`` each (z is
    overwritten)."""
    row_max = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
    column, hit = _local_targets(targets, start, z.shape[1])
    picked = torch.where(hit > 0, z.gather(1, column[:, None]).squeeze(1), 0.0)
    exp = torch.sub(z, row_max[:, None]).exp_()
    z.nan_to_num_(neginf=0.0)  # padding columns: p = 0, z·p taken as 0
    weighted = torch.bmm(exp.unsqueeze(1), z.unsqueeze(2)).view(-1)  # Σ exp·z per row
    stats = _all_reduce(torch.stack([exp.sum(-1), weighted, picked]), dist.ReduceOp.SUM, group)
    lse = row_max + torch.log(stats[0])
    return lse, stats[1] / stats[0], stats[2] - lse
