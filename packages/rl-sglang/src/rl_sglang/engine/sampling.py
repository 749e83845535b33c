"""Batched sampling from next-token logits with per-row SGLang sampling params.

Shapes: ``logits_BV`` float32, one row per running request; every per-row parameter is a
``[B]`` tensor. The returned log-prob of a token is taken from the temperature-scaled
distribution before top-k/top-p/min-p truncation (the distribution the policy defines),
and from the raw logits for greedy rows, so a teacher-forced forward of the same weights
reproduces it.

Draws are batched: every row's uniform number picks its token by inverse CDF, in one
``searchsorted`` for the whole batch. A row with a ``sampling_seed`` takes its number from
a counter-based hash of (seed, index of the token in its response) instead of a generator of
its own, so its tokens depend on neither its batch mates nor the order it was admitted in,
and no per-row kernel runs (a per-row generator cost two launches a row a step on the GPU).
"""

from dataclasses import dataclass

import torch

from rl_sglang.engine.rows import on_device


@dataclass
class RowParams:
    """Per-row sampling parameters, each ``[B]`` on the logits' device."""

    temperature: torch.Tensor
    top_k: torch.Tensor  # -1 = off
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor | None = None  # int64, -1 = unseeded; None when no row is seeded
    all_greedy: bool = False  # known on the host, so checking it costs no device sync
    truncates: bool = True  # some row uses top_k, top_p or min_p

    @classmethod
    def stack(cls, params: list, device: torch.device) -> "RowParams":
        def column(name, dtype):
            return on_device([getattr(p, name) for p in params], dtype, device)

        seeds = [-1 if p.sampling_seed is None else int(p.sampling_seed) for p in params]
        seeded = any(seed != -1 for seed in seeds)
        return cls(
            temperature=column("temperature", torch.float32),
            top_k=column("top_k", torch.long),
            top_p=column("top_p", torch.float32),
            min_p=column("min_p", torch.float32),
            seed=on_device(seeds, torch.long, device) if seeded else None,
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
    logits_BV: torch.Tensor, rows: RowParams, positions_B: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token ``[B]`` and its log-prob ``[B]`` for every row.

    Rows with temperature 0 take the argmax (log-prob from the raw logits); rows with a
    ``sampling_seed`` draw the uniform number :func:`seeded_uniform` gives their seed and
    ``positions_B`` (the index of the token in each row's response; needed when
    ``rows.seed`` is set), the others a fresh one.
    """
    logits_BV = logits_BV.float()
    if rows.all_greedy:
        return greedy_pick(logits_BV)
    greedy_B = rows.temperature == 0
    scale_B = torch.where(greedy_B, torch.ones_like(rows.temperature), rows.temperature)
    logprobs_BV = torch.log_softmax(logits_BV / scale_B[:, None], dim=-1)
    probs_BV = truncated_probs(logprobs_BV, rows) if rows.truncates else logprobs_BV.exp()
    sampled_B = inverse_cdf_draw(probs_BV, _uniforms(rows, positions_B, probs_BV.device))
    tokens_B = torch.where(greedy_B, logits_BV.argmax(dim=-1), sampled_B)
    return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)


def greedy_pick(logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax token ``[B]`` and its log-prob under the raw logits ``[B]``."""
    tokens_B = logits_BV.argmax(dim=-1)
    best_B = logits_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
    return tokens_B, best_B - logits_BV.logsumexp(dim=-1)


def inverse_cdf_draw(probs_BV: torch.Tensor, uniform_B: torch.Tensor) -> torch.Tensor:
    """The token each row's uniform number ``[B]`` in [0, 1) falls on in its (unnormalised)
    probabilities: the first index whose cumulative mass exceeds ``u x total``. The target
    is kept just below the total, so a token of zero probability is never picked."""
    cdf_BV = probs_BV.cumsum(dim=-1)
    target_B = uniform_B.to(cdf_BV.dtype) * cdf_BV[:, -1] * (1.0 - 1e-6)
    return torch.searchsorted(cdf_BV, target_B[:, None], right=True).squeeze(-1)


def _uniforms(rows: RowParams, positions_B: torch.Tensor | None, device) -> torch.Tensor:
    fresh_B = torch.rand(rows.temperature.shape[0], dtype=torch.float64, device=device)
    if rows.seed is None:
        return fresh_B
    if positions_B is None:
        raise ValueError("seeded rows need the position of the token they draw")
    return torch.where(rows.seed >= 0, seeded_uniform(rows.seed, positions_B), fresh_B)


_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB


def seeded_uniform(seed_B: torch.Tensor, position_B: torch.Tensor) -> torch.Tensor:
    """A uniform float64 in [0, 1) per row from its int64 seed and position: SplitMix64's
    output function over ``seed x golden + (position + 1) x mix1`` (wrapping int64
    arithmetic, logical shifts), the top 53 bits as the fraction."""
    x = seed_B * _GOLDEN + (position_B.to(torch.long) + 1) * _MIX1
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return _shift_right(x, 11).to(torch.float64) * 2.0**-53


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)
