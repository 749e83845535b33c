"""Sampling from logits: filters by hand, greedy, seeds, the returned log-prob."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_sglang.engine.sampling import (
    RowParams,
    inverse_cdf_draw,
    sample_next,
    seeded_uniform,
    truncated_probs,
)
from rl_sglang.protocol import SamplingParams


def rows(**kw):
    return RowParams.stack([SamplingParams(**kw)], torch.device("cpu"))


def test_truncation_by_hand():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logp = probs.log()
    # top_k 2 keeps 0.5 and 0.3
    assert torch.allclose(truncated_probs(logp, rows(top_k=2)), torch.tensor([[0.5, 0.3, 0, 0]]))
    # top_p 0.8: mass before each sorted token is 0, .5, .8, .95 -> keep the first two
    assert torch.allclose(truncated_probs(logp, rows(top_p=0.8)), torch.tensor([[0.5, 0.3, 0, 0]]))
    # top_p 0.81 keeps the third as well
    kept = truncated_probs(logp, rows(top_p=0.81))
    assert torch.allclose(kept, torch.tensor([[0.5, 0.3, 0.15, 0]]))
    # min_p 0.4: threshold 0.2 keeps 0.5 and 0.3
    assert torch.allclose(truncated_probs(logp, rows(min_p=0.4)), torch.tensor([[0.5, 0.3, 0, 0]]))
    # the top token always survives
    assert truncated_probs(logp, rows(top_p=0.01))[0, 0] == 0.5


def test_greedy_and_logprob_from_scaled_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    token, logprob = sample_next(logits, rows(temperature=0.0))
    assert token.item() == 0
    assert math.isclose(logprob.item(), torch.log_softmax(logits, -1)[0, 0].item(), rel_tol=1e-6)
    # with top_k 1 the token is the argmax and the log-prob is from logits / temperature
    token, logprob = sample_next(logits, rows(temperature=0.5, top_k=1))
    assert token.item() == 0
    expected = torch.log_softmax(logits / 0.5, -1)[0, 0].item()
    assert math.isclose(logprob.item(), expected, rel_tol=1e-6)


def test_seeded_rows_are_reproducible_and_batch_independent():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    seeds = [7, 8, None]
    params = RowParams.stack([SamplingParams(sampling_seed=s) for s in seeds], torch.device("cpu"))
    positions = torch.tensor([4, 4, 4])

    def draw():
        return sample_next(logits, params, positions)[0]

    first = draw()
    assert all(torch.equal(first[:2], draw()[:2]) for _ in range(5))
    alone = sample_next(logits[1:2], rows(sampling_seed=8), torch.tensor([4]))[0]
    assert alone.item() == first[1].item()
    # another position of the same seed is another draw
    later = [
        sample_next(logits[:1], rows(sampling_seed=7), torch.tensor([p]))[0] for p in range(40)
    ]
    assert len({t.item() for t in later}) > 5


def splitmix64_reference(seed: int, position: int) -> float:
    """The same hash in Python's unbounded integers, reduced mod 2^64 by hand."""
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    return (x >> 11) * 2.0**-53


def test_seeded_uniform_is_splitmix64_and_uniform():
    seeds = torch.tensor([0, 1, 7, 2**40 + 3, 2**62, 123456789] * 2)
    positions = torch.tensor([0, 0, 5, 17, 2**20, 4095, 1, 2, 3, 4, 5, 6])
    got = seeded_uniform(seeds, positions).tolist()
    pairs = zip(seeds.tolist(), positions.tolist(), strict=True)
    assert got == [splitmix64_reference(s, p) for s, p in pairs]
    many = seeded_uniform(torch.full((20000,), 11), torch.arange(20000))
    assert many.min() >= 0.0 and many.max() < 1.0
    counts = torch.histc(many.float(), bins=10, min=0.0, max=1.0)
    assert (counts - 2000).abs().max() < 200  # ~4.5 standard deviations


def test_inverse_cdf_draws_follow_the_probabilities_and_skip_zeros():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    uniform = torch.rand(40000, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    tokens = inverse_cdf_draw(probs.repeat(40000, 1), uniform)
    freq = torch.bincount(tokens, minlength=6).double() / 40000
    assert freq[[0, 2, 5]].sum() == 0
    assert torch.allclose(freq, probs.double(), atol=0.015)
    edges = inverse_cdf_draw(probs.repeat(3, 1), torch.tensor([0.0, 0.9999999999, 1.0]))
    assert edges.tolist() == [1, 4, 4]  # never the zero-probability tail, even at u = 1


def test_top_k_restricts_the_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]]).repeat(200, 1)
    params = RowParams.stack([SamplingParams(top_k=2, temperature=2.0)] * 200, torch.device("cpu"))
    tokens, _ = sample_next(logits, params)
    assert set(tokens.tolist()) == {0, 1}


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-8, 8), min_size=2, max_size=12),
    top_k=st.sampled_from([-1, 1, 2, 5]),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
)
def test_truncation_keeps_a_prefix_of_the_sorted_tokens(logits, top_k, top_p, min_p):
    logp = torch.log_softmax(torch.tensor([logits]), -1)
    kept = truncated_probs(logp, rows(top_k=top_k, top_p=top_p, min_p=min_p))[0]
    probs = logp.exp()[0]
    order = probs.argsort(descending=True)
    flags = (kept[order] > 0).tolist()
    num_kept = sum(flags)
    assert flags == [True] * num_kept + [False] * (len(flags) - num_kept)  # a sorted prefix
    assert num_kept >= 1 and (top_k == -1 or num_kept <= top_k)
    kept_probs = probs[order][:num_kept]
    assert float(kept_probs[:-1].sum()) < top_p + 1e-6  # the nucleus stops once top_p is reached
    assert float(kept_probs.min()) >= min_p * float(probs.max()) - 1e-6 or num_kept == 1
    assert torch.equal(kept[order][:num_kept], kept_probs)  # kept probabilities are unchanged
