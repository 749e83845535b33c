"""A policy loss and a reducer given by dotted path (algorithm.policy_loss /
loss_agg_mode), as a user writes them: test_fsdp_objective.py trains FSDP with them."""

import torch


def ratio_pg_loss(
    log_probs, old_log_probs, advantages, mask, *, clip_low, clip_high, dual_clip, cu_seqlens
):
    """-A x ratio per token, unclipped."""
    ratio = torch.exp(log_probs - old_log_probs)
    return -advantages * ratio, torch.zeros_like(log_probs)


def token_sum_over_global(per_token, mask, *, cu_seqlens, num_tokens, num_seqs, norm_length):
    """Sum over the valid tokens divided by twice the step's global token count."""
    return (per_token * mask.to(per_token.dtype)).sum() / (2.0 * float(num_tokens))
