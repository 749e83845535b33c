"""Sampling from logits: filters by hand, greedy, seeds, the returned log-prob."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_sglang.engine.sampling import RowParams, sample_next, truncated_probs
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
    token, logprob = sample_next(logits, rows(temperature=0.0), [None])
    assert token.item() == 0
    assert math.isclose(logprob.item(), torch.log_softmax(logits, -1)[0, 0].item(), rel_tol=1e-6)
    # with top_k 1 the token is the argmax and the log-prob is from logits / temperature
    token, logprob = sample_next(logits, rows(temperature=0.5, top_k=1), [None])
    assert token.item() == 0
    expected = torch.log_softmax(logits / 0.5, -1)[0, 0].item()
    assert math.isclose(logprob.item(), expected, rel_tol=1e-6)


def test_seeded_rows_are_reproducible_and_batch_independent():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = RowParams.stack([SamplingParams(temperature=1.0)] * 3, torch.device("cpu"))

    def draw(seed):
        gens = [torch.Generator().manual_seed(seed) for _ in range(3)]
        return sample_next(logits, params, gens)[0]

    assert torch.equal(draw(7), draw(7))
    alone = sample_next(logits[1:2], rows(), [torch.Generator().manual_seed(7)])[0]
    assert alone.item() == draw(7)[1].item()


def test_top_k_restricts_the_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]]).repeat(200, 1)
    params = RowParams.stack([SamplingParams(top_k=2, temperature=2.0)] * 200, torch.device("cpu"))
    tokens, _ = sample_next(logits, params, [None] * 200)
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
