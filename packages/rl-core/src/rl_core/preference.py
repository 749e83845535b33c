"""Offline preference losses: DPO (sigmoid, with optional label smoothing) and IPO.

Each pair has a chosen and a rejected response to one prompt. The inputs are *sequence*
log-probs ``[P]`` (one value per pair) of the policy and of a frozen reference; build
them from per-token log-probs with :func:`sequence_log_probs`. With

    margin = (log pi(chosen) - log pi(rejected)) - (log ref(chosen) - log ref(rejected))

- ``sigmoid`` (DPO, Rafailov et al. 2023, eq. 7; conservative DPO with label smoothing
  ``eps``): ``-(1 - eps) * log sigmoid(beta * margin) - eps * log sigmoid(-beta * margin)``
- ``ipo`` (Azar et al. 2023, eq. 17): ``(margin - 1 / (2 * beta)) ** 2``. TRL feeds IPO
  length-averaged log-probs; pass ``sequence_log_probs(..., average=True)`` to match it.

The implicit rewards ``beta * (log pi - log ref)`` of each side give the usual metrics:
reward accuracy (chosen above rejected) and the mean reward margin.
"""

import torch
import torch.nn.functional as F

from rl_core._dtype import wide
from rl_core.aggregation import row_sums_and_counts
from rl_core.names import PREFERENCE_LOSSES


def sequence_log_probs(
    token_log_probs: torch.Tensor, mask: torch.Tensor, *, average: bool = False
) -> torch.Tensor:
    """Sum (or mean, ``average=True``) of ``token_log_probs`` ``[B, T]`` over the response
    tokens ``mask`` ``[B, T]``: one log-prob per sequence ``[B]``. A row without response
    tokens is refused (its log-prob would be 0 and its mean undefined)."""
    mask = mask.to(wide(token_log_probs).dtype)
    counts = mask.sum(dim=-1)
    if bool((counts == 0).any()):
        raise ValueError("sequence_log_probs: a sequence has no response tokens in its mask")
    sums = (wide(token_log_probs) * mask).sum(dim=-1)
    return sums / counts if average else sums


def dpo_loss(
    chosen_log_probs: torch.Tensor,
    rejected_log_probs: torch.Tensor,
    ref_chosen_log_probs: torch.Tensor,
    ref_rejected_log_probs: torch.Tensor,
    *,
    beta: float = 0.1,
    kind: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair preference loss ``[P]`` and detached metrics (mean over the pairs).

    Args:
        chosen_log_probs, rejected_log_probs: policy sequence log-probs ``[P]``.
        ref_chosen_log_probs, ref_rejected_log_probs: the reference's, same shape
            (computed once, without gradient).
        beta: strength of the implicit KL constraint (> 0).
        kind: one of ``PREFERENCE_LOSSES``.
        label_smoothing: the assumed share of flipped labels, in [0, 0.5) (sigmoid only).
    Returns:
        ``(loss, metrics)``: the per-pair loss (reduce with ``.mean()`` or a global sum over
        data-parallel ranks divided by the global number of pairs), and ``pref/loss``,
        ``pref/accuracy``, ``pref/margin``, ``pref/chosen_reward``, ``pref/rejected_reward``.
    """
    _check(kind, beta, label_smoothing)
    chosen_reward = wide(chosen_log_probs) - wide(ref_chosen_log_probs)
    rejected_reward = wide(rejected_log_probs) - wide(ref_rejected_log_probs)
    margin = chosen_reward - rejected_reward
    if kind == "ipo":
        loss = (margin - 1.0 / (2.0 * beta)) ** 2
    else:
        loss = -(1.0 - label_smoothing) * F.logsigmoid(beta * margin)
        loss = loss - label_smoothing * F.logsigmoid(-beta * margin)
    return loss, _metrics(loss, beta * chosen_reward.detach(), beta * rejected_reward.detach())


def packed_pair_loss(
    *,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_pairs: float,
    beta: float = 0.1,
    kind: str = "sigmoid",
    label_smoothing: float = 0.0,
    tensor_metrics: bool = False,
) -> tuple[torch.Tensor, dict]:
    """:func:`dpo_loss` of packed pairs: this micro-batch's share of the step's mean loss.

    Shapes: ``log_probs``, ``ref_log_probs``, ``mask`` ``[N]`` packed over ``2P``
    sequences (``cu_seqlens`` ``[2P + 1]``), each pair as two neighbours, chosen first.
    The loss is the sum over these pairs divided by ``num_pairs``, the step's pairs over
    every micro-batch and data-parallel rank, so micro-batching and the layout never change
    the step's loss; each metric is scaled the same way (sum the shares to get the mean).
    A batch holding no whole pair (a rank's padding micro-batch) gives a zero loss that
    still reaches every parameter of ``log_probs``'s graph.
    """
    num_seqs = cu_seqlens.numel() - 1
    if num_seqs % 2:
        if num_seqs == 1 and not bool(mask.any()):  # an empty micro-batch's one-token dummy
            zero = (wide(log_probs) * 0).sum()
            keys = (
                "pref/loss",
                "pref/accuracy",
                "pref/margin",
                "pref/chosen_reward",
                "pref/rejected_reward",
            )
            return zero, {k: zero.detach() if tensor_metrics else 0.0 for k in keys}
        raise ValueError(f"{num_seqs} sequences do not make pairs (chosen, rejected, ...)")
    policy, _ = row_sums_and_counts(wide(log_probs), mask, cu_seqlens)
    ref, _ = row_sums_and_counts(wide(ref_log_probs).detach(), mask, cu_seqlens)
    losses, metrics = dpo_loss(
        policy[0::2],
        policy[1::2],
        ref[0::2],
        ref[1::2],
        beta=beta,
        kind=kind,
        label_smoothing=label_smoothing,
    )
    share = (num_seqs // 2) / max(float(num_pairs), 1.0)
    metrics = {k: v * share if tensor_metrics else float(v) * share for k, v in metrics.items()}
    return losses.sum() / max(float(num_pairs), 1.0), metrics


def _check(kind: str, beta: float, label_smoothing: float) -> None:
    if kind not in PREFERENCE_LOSSES:
        raise ValueError(f"preference loss {kind!r}: known {', '.join(PREFERENCE_LOSSES)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if kind == "ipo" and label_smoothing:
        raise ValueError("label_smoothing applies to the sigmoid loss only, not ipo")


def _metrics(loss, chosen_reward, rejected_reward) -> dict[str, torch.Tensor]:
    return {
        "pref/loss": loss.detach().mean(),
        "pref/accuracy": (chosen_reward > rejected_reward).to(chosen_reward.dtype).mean(),
        "pref/margin": (chosen_reward - rejected_reward).mean(),
        "pref/chosen_reward": chosen_reward.mean(),
        "pref/rejected_reward": rejected_reward.mean(),
    }
