"""A policy loss and a reducer a test run passes by dotted path (on PYTHONPATH), each
leaving a mark no built-in can: every token counted as clipped, every aggregate x100."""

import torch


def all_clipped_pg(
    log_probs, old_log_probs, advantages, mask, *, clip_low, clip_high, dual_clip, cu_seqlens
):
    return -advantages * torch.exp(log_probs - old_log_probs), torch.ones_like(log_probs)


def hundredfold_token_mean(per_token, mask, *, cu_seqlens, num_tokens, num_seqs, norm_length):
    weights = mask.to(per_token.dtype)
    return 100.0 * (per_token * weights).sum() / float(num_tokens or weights.sum())
