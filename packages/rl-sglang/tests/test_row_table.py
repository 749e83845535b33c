"""The running batch as arrays (engine.row_table): a round's bookkeeping stops every row
exactly where the per-request stop checker would, and the table follows the batch's
membership (rows leaving, rows joining) with the same sampling tensors a rebuild gives."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_sglang.engine.request import Request
from rl_sglang.engine.row_table import RowTable, append_round
from rl_sglang.engine.sampling import RowParams
from rl_sglang.engine.stopping import StopChecker
from rl_sglang.protocol import SamplingParams

CPU = torch.device("cpu")
EOS = 2


class CharTokenizer:
    """Token i is the letter chr(ord('a') + i): stop strings can be matched."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def request(index: int, **params) -> Request:
    return Request(f"r{index}", None, [1, 1, 1], SamplingParams(**params))


def table_of(requests, stopper) -> RowTable:
    return RowTable.of(requests, stopper, RowParams.stack([r.params for r in requests], CPU))


def reference_round(requests, stopper, tokens_KB, logprobs_KB) -> dict[int, dict]:
    """What the scheduler did before the table: every row, every step, one check."""
    finished: dict[int, dict] = {}
    for tokens, logprobs in zip(tokens_KB.tolist(), logprobs_KB.tolist(), strict=True):
        for row, req in enumerate(requests):
            if row in finished:
                continue
            req.output_ids.append(tokens[row])
            req.output_logprobs.append(logprobs[row])
            if req.on_token is not None:
                req.on_token(req)
            reason = stopper.check(req)
            if reason is not None:
                finished[row] = reason
    return finished


row_params = st.fixed_dictionaries(
    {
        "max_new_tokens": st.integers(1, 6),
        "ignore_eos": st.booleans(),
        "stop_token_ids": st.lists(st.integers(0, 5), max_size=2),
        "stop": st.sampled_from([[], ["cd"], ["e", "ff"]]),
        "temperature": st.sampled_from([0.0, 1.0]),
    }
)


@settings(max_examples=150, deadline=None)
@given(
    params=st.lists(row_params, min_size=1, max_size=6),
    streamed=st.lists(st.booleans(), min_size=6, max_size=6),
    steps=st.integers(1, 4),
    rounds=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_rounds_stop_every_row_where_the_stop_checker_does(params, streamed, steps, rounds, seed):
    stopper = StopChecker(CharTokenizer(), {EOS}, max_context=12)
    seen: dict[str, list] = {"fast": [], "slow": []}  # (rid, length) at each callback

    def batch(name):
        def on_token(req):
            seen[name].append((req.rid, len(req.output_ids)))

        made = [request(i, **p) for i, p in enumerate(params)]
        for req, stream in zip(made, streamed, strict=False):
            req.on_token = on_token if stream else None
        return made

    fast, slow = batch("fast"), batch("slow")
    table = table_of(fast, stopper)
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        if not fast:
            break
        tokens = rng.integers(0, 7, size=(steps, len(fast)))
        logprobs = rng.standard_normal((steps, len(fast))).astype(np.float32)
        got = append_round(table, fast, tokens, logprobs, stopper)
        want = reference_round(slow, stopper, tokens, logprobs)
        assert got == want
        assert sorted(seen["fast"]) == sorted(seen["slow"])  # each callback, same lengths
        for row in got:  # a finished row's request holds its whole response
            assert fast[row].output_ids == slow[row].output_ids
        table.flush(fast, range(len(fast)))  # the running rows' lists on demand
        for a, b in zip(fast, slow, strict=True):
            assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
        assert table.lengths.tolist() == [len(r.output_ids) for r in fast]
        kept = [row for row in range(len(fast)) if row not in got]
        fast, slow = [fast[r] for r in kept], [slow[r] for r in kept]
        table = table.take(kept, torch.tensor(kept, dtype=torch.long))


def test_a_multi_step_round_drops_a_rows_tokens_after_its_stop():
    stopper = StopChecker(None, {EOS}, max_context=64)
    requests = [request(0, temperature=0), request(1, temperature=0)]
    table = table_of(requests, stopper)
    tokens = np.array([[5, 5], [EOS, 5], [6, 6]])
    finished = append_round(table, requests, tokens, np.zeros((3, 2), np.float32), stopper)
    assert finished == {0: {"type": "stop", "matched": EOS}}
    assert requests[0].output_ids == [5, EOS] and requests[1].output_ids == []
    table.flush(requests, [1])
    assert requests[1].output_ids == [5, 5, 6]
    assert table.lengths.tolist() == [2, 3] and table.rooms(0).tolist() == [59, 58]


def test_the_table_follows_rows_leaving_and_joining_with_the_same_sampling_tensors():
    stopper = StopChecker(None, {EOS}, max_context=64)
    first = [
        request(0, temperature=0),
        request(1, top_k=3, sampling_seed=7),
        request(2, top_p=0.5, stop_token_ids=[4, 5, 6]),
    ]
    second = [request(3, temperature=0), request(4, min_p=0.1, max_new_tokens=3, sampling_seed=5)]
    for req in first + second:
        req.output_ids = [9] * int(req.rid[1:])
    kept = table_of(first, stopper).take([2, 0], torch.tensor([2, 0]))
    assert kept.params.seed is None and kept.positions(0) is None  # the seeded row left
    table = kept.cat(table_of(second, stopper))
    members = [first[2], first[0], *second]
    rebuilt = table_of(members, stopper)
    for name in ("temperature", "top_k", "top_p", "min_p", "seed"):
        assert torch.equal(getattr(table.params, name), getattr(rebuilt.params, name)), name
    assert table.params.seed.tolist() == [-1, -1, -1, 5]
    assert (table.params.all_greedy, table.params.truncates) == (False, True)
    for name in ("lengths", "limits", "watched", "greedy", "truncating", "seeded"):
        assert np.array_equal(getattr(table, name), getattr(rebuilt, name)), name
    assert table.stop_ids.tolist() == [
        [2, 4, 5, 6],
        [2, -1, -1, -1],
        [2, -1, -1, -1],
        [2, -1, -1, -1],
    ]
    assert table.positions(1).tolist() == [3, 1, 4, 5]
    greedy_only = table.take([1, 2], torch.tensor([1, 2]))
    assert greedy_only.params.all_greedy and not greedy_only.params.truncates


@settings(max_examples=100, deadline=None)
@given(
    params=st.lists(row_params, min_size=1, max_size=8),
    streamed=st.lists(st.booleans(), min_size=8, max_size=8),
    events=st.lists(
        st.tuples(st.sampled_from(["round", "abort", "join"]), st.integers(1, 3), st.integers()),
        min_size=1,
        max_size=12,
    ),
    seed=st.integers(0, 2**16),
)
def test_buffered_rows_give_the_requests_the_per_row_path_gives(params, streamed, events, seed):
    """The scheduler's life of a batch on the table (rounds of K steps, rows aborted
    mid-batch with their partial output, rows joining with tokens of their own) gives every
    request, whenever it leaves and at the end, the lists and callbacks that appending
    every token to every row gives."""
    stopper = StopChecker(CharTokenizer(), {EOS}, max_context=40)
    seen: dict[str, list] = {"fast": [], "slow": []}
    rng = np.random.default_rng(seed)

    def make(name, index):
        req = request(index, **params[index % len(params)])
        req.output_ids = [3] * (index % 3)  # a retracted request comes back with tokens
        req.output_logprobs = [-1.0] * (index % 3)
        if streamed[index % len(streamed)]:
            req.on_token = lambda r: seen[name].append((r.rid, len(r.output_ids)))
        return req

    first = range(len(params))
    fast, slow = [make("fast", i) for i in first], [make("slow", i) for i in first]
    table, left, next_index = table_of(fast, stopper), [], len(params)
    for kind, count, pick in events:
        if kind == "join":
            new = range(next_index, next_index + count)
            next_index += count
            joining = [make("fast", i) for i in new]
            table = table.cat(table_of(joining, stopper)) if fast else table_of(joining, stopper)
            fast, slow = fast + joining, slow + [make("slow", i) for i in new]
            continue
        if not fast:
            continue
        if kind == "abort":
            gone = sorted({pick % len(fast), (pick // 7) % len(fast)})
            table.flush(fast, gone)
        else:
            tokens = rng.integers(0, 7, size=(count, len(fast)))
            logprobs = rng.standard_normal((count, len(fast)))  # float64 kept exactly
            gone = sorted(append_round(table, fast, tokens, logprobs, stopper))
            assert gone == sorted(reference_round(slow, stopper, tokens, logprobs))
            assert sorted(seen["fast"]) == sorted(seen["slow"])
        left += [(fast[row], slow[row]) for row in gone]
        kept = [row for row in range(len(fast)) if row not in gone]
        fast, slow = [fast[r] for r in kept], [slow[r] for r in kept]
        table = table.take(kept, torch.tensor(kept, dtype=torch.long))
    if fast:
        table.flush(fast, range(len(fast)))
    for a, b in left + list(zip(fast, slow, strict=True)):
        assert (a.rid, a.output_ids, a.output_logprobs) == (b.rid, b.output_ids, b.output_logprobs)
    assert table.lengths.tolist() == [len(r.output_ids) for r in fast]


def test_the_output_buffer_grows_past_its_columns_and_slots():
    stopper = StopChecker(None, {EOS}, max_context=1000)
    requests = [request(i, max_new_tokens=300, ignore_eos=True) for i in range(3)]
    table = table_of(requests, stopper)
    columns = table.outputs.tokens.shape[1]
    tokens = np.arange(3 * (columns + 5)).reshape(columns + 5, 3) % 100 + 10
    append_round(table, requests, tokens, np.zeros(tokens.shape, np.float32), stopper)
    joining = [request(i, max_new_tokens=300) for i in range(3, 3 + table.outputs.num_slots)]
    table = table.cat(table_of(joining, stopper))  # more rows than the buffer has slots
    table.flush(requests + joining, range(len(table)))
    assert [r.output_ids for r in requests] == tokens.T.tolist()
    assert sorted(table.slots.tolist()) == list(range(len(table)))  # each slot once
    assert table.outputs.num_slots >= len(table)
