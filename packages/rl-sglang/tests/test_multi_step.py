"""Multi-step greedy decoding of the static runner: K steps in one round give the same
tokens, log-probs, caches and responses as K single steps, stops inside a round are
trimmed, and rounds never run past a row's length limit."""

import asyncio

import pytest
import torch

from rl_sglang.engine.core import Engine
from rl_sglang.engine.static import StaticRunner


def test_greedy_steps_equal_single_steps_bit_for_bit(tiny_model):
    prompts = [[1, 2, 3], [9] * 11, [5]]
    runners = [StaticRunner(tiny_model, max_slots=4, max_len=64, multi_step=k) for k in (1, 4)]
    for runner in runners:
        logits_BV, state = runner.prefill(prompts)
        runner.merge(None, state)
        runner.first = logits_BV.argmax(dim=-1)
    single, multi = runners
    tokens, logprobs = single.first, []
    steps = []
    for _ in range(4):
        tokens, logprob = single.decode(state, tokens, greedy=True)
        steps.append(tokens)
        logprobs.append(logprob)
    multi_tokens, multi_logprobs = multi.decode(state, multi.first, greedy=True, steps=4)
    assert torch.equal(multi_tokens, torch.stack(steps))
    assert torch.equal(multi_logprobs, torch.stack(logprobs))
    assert multi.host_lengths == single.host_lengths == [7, 15, 5]
    assert torch.equal(multi.lengths, single.lengths)
    for a, b in zip(single.keys + single.values, multi.keys + multi.values, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="greedy with 4 steps"):
        multi.decode(state, multi.first, steps=4)  # sampling rounds are single steps


def run(engine, body):
    async def go():
        groups, _ = engine.make_requests(body)
        return await engine.run([r for group in groups for r in group])

    return asyncio.run(go())


@pytest.fixture(scope="module")
def engines(tiny_dir):
    from rl_sglang.engine.core import load_model

    model, tokenizer = load_model(str(tiny_dir))
    made = {
        k: Engine(model, tokenizer, max_batch_size=4, runner="static", max_context=64, multi_step=k)
        for k in (1, 5)
    }
    yield made
    for engine in made.values():
        engine.scheduler.stop()


def test_multi_step_responses_equal_single_step_ones(engines, monkeypatch):
    """Stops by token, string, EOS, budget and context, rows joining a full batch: the
    same responses with 5-step rounds as with single steps; rounds of 5 really ran."""
    prompts = [[1, 2, 3], [9] * 11, [5], [7, 8], [100, 101, 102, 103, 104], [42] * 40]
    reference = run(
        engines[1],
        {
            "input_ids": prompts[:1],
            "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True},
        },
    )
    stop_token = reference[0]["output_ids"][12]
    params = [
        {"max_new_tokens": 30, "stop_token_ids": [stop_token]},
        {"max_new_tokens": 17},
        {"max_new_tokens": 23, "stop": ["a", "e"]},
        {"max_new_tokens": 3},
        {"max_new_tokens": 40},
        {"max_new_tokens": 40},  # 40 prompt tokens + 24 = the 64-token context
    ]
    body = {
        "input_ids": prompts,
        "return_logprob": True,
        "sampling_params": [{**p, "temperature": 0} for p in params],
    }
    multi = engines[5].scheduler.runner
    rounds = []
    decode = multi.decode
    monkeypatch.setattr(
        multi, "decode", lambda *a, **k: rounds.append(k.get("steps")) or decode(*a, **k)
    )
    outs = {k: run(engine, body) for k, engine in engines.items()}
    assert 5 in rounds and set(rounds) <= {1, 5}
    for single, many in zip(outs[1], outs[5], strict=True):
        meta_single, meta_many = single["meta_info"], many["meta_info"]
        assert many["output_ids"] == single["output_ids"]
        assert meta_many["finish_reason"] == meta_single["finish_reason"]
        assert meta_many["output_token_logprobs"] == meta_single["output_token_logprobs"]
    assert outs[5][0]["output_ids"][-1] == stop_token
    assert outs[5][0]["meta_info"]["finish_reason"]["type"] == "stop"
    assert [len(o["output_ids"]) for o in outs[5]][3:] == [3, 40, 24]


def test_rounds_stay_within_each_rows_length_limit(engines):
    """A round of K steps starts only when every row has room for K more tokens: budgets
    of 7 and 12 with K = 5 give rounds 5 (+1 from prefill = 6) then single steps."""
    scheduler = engines[5].scheduler
    seen = []
    original = scheduler._round_steps

    def spy(pending):
        steps = original(pending)
        seen.append((steps, scheduler._table.rooms(pending).tolist()))
        return steps

    scheduler._round_steps = spy
    try:
        body = {
            "input_ids": [[1, 2], [3, 4]],
            "sampling_params": [
                {"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (7, 12)
            ],
        }
        outs = run(engines[5], body)
    finally:
        del scheduler._round_steps
    assert [len(o["output_ids"]) for o in outs] == [7, 12]
    assert seen and all(min(rooms) >= steps for steps, rooms in seen)
    assert seen[0] == (5, [6, 11])  # the prefill gave each row its first token


@pytest.fixture(scope="module")
def sampled_engine(tiny_dir):
    from rl_sglang.engine.core import load_model

    model, tokenizer = load_model(str(tiny_dir))
    engine = Engine(
        model,
        tokenizer,
        max_batch_size=4,
        runner="static",
        max_context=64,
        multi_step=5,
        sampled_multi_step=True,
    )
    yield engine
    engine.scheduler.stop()


def test_sampled_rounds_give_seeded_rows_the_single_step_tokens(
    engines, sampled_engine, monkeypatch
):
    """Seeded sampling (temperatures, top-k, top-p, min-p, a greedy row), stops by token,
    string and budget, rows joining a full batch: the same tokens and log-probs with
    5-step sampled rounds as with single steps; sampled rounds of 5 really ran."""
    prompts = [[1, 2, 3], [9] * 11, [5], [7, 8], [100, 101, 102, 103, 104], [42] * 30]
    params = [
        {"temperature": 0.9, "max_new_tokens": 30, "stop_token_ids": [101, 102, 103]},
        {"temperature": 1.0, "max_new_tokens": 17, "top_k": 20},
        {"temperature": 0.7, "max_new_tokens": 23, "stop": ["a", "e"], "top_p": 0.8},
        {"temperature": 0.0, "max_new_tokens": 9},
        {"temperature": 1.2, "max_new_tokens": 40, "min_p": 0.05},
        {"temperature": 1.0, "max_new_tokens": 34},  # 30 prompt tokens + 34 = the context
    ]
    body = {
        "input_ids": prompts,
        "return_logprob": True,
        "sampling_params": [{**p, "sampling_seed": 11 + i} for i, p in enumerate(params)],
    }
    runner = sampled_engine.scheduler.runner
    rounds = []
    decode_sampled = runner.decode_sampled
    monkeypatch.setattr(
        runner,
        "decode_sampled",
        lambda *a, **k: rounds.append(a[-1]) or decode_sampled(*a, **k),
    )
    single, many = run(engines[1], body), run(sampled_engine, body)
    assert rounds and set(rounds) == {5}
    for one, other in zip(single, many, strict=True):
        assert other["output_ids"] == one["output_ids"]
        assert other["meta_info"]["finish_reason"] == one["meta_info"]["finish_reason"]
        assert (
            other["meta_info"]["output_token_logprobs"] == one["meta_info"]["output_token_logprobs"]
        )
    assert [len(o["output_ids"]) for o in many][3:] == [9, 40, 34]
    unseeded = {**body, "sampling_params": params}  # runs; its draws are its own
    assert [len(o["output_ids"]) for o in run(sampled_engine, unseeded)][3:] == [9, 40, 34]


def test_sampled_rounds_are_refused_where_off(engines):
    runner = engines[5].scheduler.runner
    assert runner.sampled_multi_step is False
    with pytest.raises(ValueError, match="sampled multi-step rounds"):
        runner.decode_sampled(None, torch.zeros(1, dtype=torch.long), None, None, 5)


@pytest.mark.gpu
def test_sampled_rounds_in_cuda_graphs_match_single_steps():
    """On CUDA (compiled step, CUDA graphs): seeded rows get the same tokens from the
    sampled K-step graphs as from single steps, with and without truncation."""
    from rl_sglang.tiny import random_model, tiny_config

    model = random_model(tiny_config(num_hidden_layers=4), seed=2).cuda()
    body = {
        "input_ids": [[3 + i] * (4 + 7 * i) for i in range(6)],
        "return_logprob": True,
        "sampling_params": [
            {
                "temperature": 1.0,
                "max_new_tokens": 40,
                "sampling_seed": i,
                "top_p": 0.9 if i % 2 else 1.0,
            }
            for i in range(6)
        ],
    }
    outs = {}
    for sampled in (False, True):
        engine = Engine(
            model, None, max_batch_size=8, max_context=128, multi_step=5, sampled_multi_step=sampled
        )
        outs[sampled] = run(engine, body)
        if sampled:
            assert {truncates for _, truncates in engine.scheduler.runner.graphs.sampled} == {True}
        engine.scheduler.stop()
    for one, other in zip(outs[False], outs[True], strict=True):
        assert other["output_ids"] == one["output_ids"]
        got = [lp for lp, *_ in other["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, *_ in one["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-5)
