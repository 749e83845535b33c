"""Batched sampling from next-token logits with per-row SGLang sampling params.

Shapes: ``logits_BV`` float32, one row per running request; every per-row parameter is a
``[B]`` tensor. The returned log-prob of a token is taken from the temperature-scaled
distribution before top-k/top-p/min-p truncation (the distribution the policy defines),
and from the raw logits for greedy rows, so a teacher-forced forward of the same weights
reproduces it.
"""

from dataclasses import dataclass

import torch


@dataclass
class RowParams:
    """Per-row sampling parameters, each ``[B]`` on the logits' device."""

    temperature: torch.Tensor
    top_k: torch.Tensor  # -1 = off
    top_p: torch.Tensor
    min_p: torch.Tensor
    all_greedy: bool = False  # known on the host, so checking it costs no device sync
    truncates: bool = True  # some row uses top_k, top_p or min_p

    @classmethod
    def stack(cls, params: list, device: torch.device) -> "RowParams":
        def column(name, dtype):
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)

        return cls(
            temperature=column("temperature", torch.float32),
            top_k=column("top_k", torch.long),
            top_p=column("top_p", torch.float32),
            min_p=column("min_p", torch.float32),
            all_greedy=all(p.temperature == 0 for p in params),
            truncates=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
        )


def truncated_probs(logprobs_BV: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """Probabilities after top-k, top-p and min-p filtering (not renormalised)."""
    probs_BV = logprobs_BV.exp()
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    rank_V = torch.arange(probs_BV.shape[-1], device=probs_BV.device)
    top_k_B = torch.where(rows.top_k > 0, rows.top_k, probs_BV.shape[-1])
    drop_BV = rank_V[None, :] >= top_k_B[:, None]
    mass_before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV
    drop_BV |= mass_before_BV >= rows.top_p[:, None]
    drop_BV |= sorted_BV < rows.min_p[:, None] * sorted_BV[:, :1]
    drop_BV[:, 0] = False  # the most likely token always survives
    sorted_BV = sorted_BV.masked_fill(drop_BV, 0.0)
    return torch.zeros_like(probs_BV).scatter_(-1, order_BV, sorted_BV)


def sample_next(
    logits_BV: torch.Tensor,
    rows: RowParams,
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token ``[B]`` and its log-prob ``[B]`` for every row.

    Rows with temperature 0 take the argmax (log-prob from the raw logits); rows with their own generator
    (a ``sampling_seed``) draw with it, so their output does not depend on batch mates.
    """
    logits_BV = logits_BV.float()
    if rows.all_greedy:
        return greedy_pick(logits_BV)
    greedy_B = rows.temperature == 0
    scale_B = torch.where(greedy_B, torch.ones_like(rows.temperature), rows.temperature)
    logprobs_BV = torch.log_softmax(logits_BV / scale_B[:, None], dim=-1)
    probs_BV = truncated_probs(logprobs_BV, rows) if rows.truncates else logprobs_BV.exp()
    sampled_B = _draw(probs_BV, generators)
    tokens_B = torch.where(greedy_B, logits_BV.argmax(dim=-1), sampled_B)
    return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)


def greedy_pick(logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax token ``[B]`` and its log-prob under the raw logits ``[B]``."""
    tokens_B = logits_BV.argmax(dim=-1)
    best_B = logits_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
    return tokens_B, best_B - logits_BV.logsumexp(dim=-1)


def _draw(probs_BV: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One multinomial draw per row; seeded rows use their own generator."""
    tokens_B = torch.multinomial(probs_BV, 1).squeeze(-1)
    for row, generator in enumerate(generators):
        if generator is not None:
            tokens_B[row] = torch.multinomial(probs_BV[row], 1, generator=generator)[0]
    return tokens_B
