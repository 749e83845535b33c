"""The embedded engine in-process: log-probs equal a teacher-forced forward, greedy equals
model.generate, continuous admission, stops, n and seeds, abort and pause modes."""

import logging
import threading

import pytest
import torch

from conftest import generate, teacher_forced_logprobs
from rl_sglang.engine.core import Engine, load_model


@pytest.fixture(scope="module", params=["dynamic", "static"])
def engine(tiny_dir, request):
    """Both runners: the left-padded dynamic cache and the static slot cache (eager here,
    CUDA graphs on GPU)."""
    model, tokenizer = load_model(str(tiny_dir))
    engine = Engine(
        model,
        tokenizer,
        model_path=str(tiny_dir),
        max_batch_size=4,
        runner=request.param,
        max_context=2048,
    )
    assert engine.runner_kind == request.param
    yield engine
    engine.scheduler.stop()


def logprobs_of(out):
    return [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]


def test_logprobs_match_teacher_forcing_in_a_mixed_batch(engine, tiny_model):
    # 6 prompts of different lengths with max_batch_size 4: two join mid-generation
    prompts = [[1, 2, 3], [9] * 11, [5], [7, 8], [100, 101, 102, 103, 104], [42] * 4]
    for temperature in (1.0, 0.7):
        params = {"max_new_tokens": 10, "temperature": temperature, "ignore_eos": True}
        outs = generate(engine, input_ids=prompts, sampling_params=params, return_logprob=True)
        for prompt, out in zip(prompts, outs, strict=True):
            assert len(out["output_ids"]) == 10 == out["meta_info"]["completion_tokens"]
            expected = teacher_forced_logprobs(tiny_model, prompt, out["output_ids"], temperature)
            assert logprobs_of(out) == pytest.approx(expected, abs=1e-4)


def test_rows_leaving_while_the_next_round_is_in_flight_keep_their_tokens(engine, caplog):
    """Rows stop on a token while the scheduler has the next round queued (the look-ahead
    keeps going after rows leave): each row's output equals its output alone, whether a
    few rows or all of them stop in the same round, and no step fails."""
    prompt, params = [1, 2, 3], {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    (alone,) = generate(engine, input_ids=[prompt], sampling_params=params)
    stop = {**params, "ignore_eos": False, "stop_token_ids": [alone["output_ids"][4]]}
    cut = alone["output_ids"][: alone["output_ids"].index(stop["stop_token_ids"][0]) + 1]
    sampled = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}
    mixed = [stop, stop, sampled, {**sampled, "sampling_seed": 8}]  # two stop, two go on
    for batch in ([stop] * 4, mixed):
        outs = generate(engine, input_ids=[prompt] * 4, sampling_params=batch)
        for out, row_params in zip(outs, batch, strict=True):
            (own,) = generate(engine, input_ids=[prompt], sampling_params=row_params)
            assert out["output_ids"] == own["output_ids"]
            if row_params is stop:
                assert out["output_ids"] == cut
                assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_greedy_equals_model_generate(engine, tiny_model):
    prompts = [[1, 2, 3], [50, 60, 70, 80, 90]]
    outs = generate(
        engine,
        input_ids=prompts,
        sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
    )
    for prompt, out in zip(prompts, outs, strict=True):
        ref = tiny_model.generate(
            torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False
        )
        assert out["output_ids"] == ref[0, len(prompt) :].tolist()
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_stop_token_and_stop_string(engine, tokenizer):
    greedy = generate(
        engine,
        input_ids=[1, 2, 3],
        sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    )[0]
    third = greedy["output_ids"][2]
    out = generate(
        engine,
        input_ids=[1, 2, 3],
        sampling_params={
            "max_new_tokens": 8,
            "temperature": 0,
            "stop_token_ids": [third],
            "ignore_eos": True,
        },
    )[0]
    assert out["output_ids"] == greedy["output_ids"][: greedy["output_ids"].index(third) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": third}
    long = generate(
        engine,
        input_ids=[1, 2, 3],
        sampling_params={"max_new_tokens": 60, "temperature": 0, "ignore_eos": True},
    )[0]["output_ids"]
    position = next(i for i, t in enumerate(long) if i > 0 and 65 <= t <= 122)  # an ASCII letter
    stop_text = chr(long[position])
    out = generate(
        engine,
        input_ids=[1, 2, 3],
        sampling_params={
            "max_new_tokens": 60,
            "temperature": 0,
            "stop": [stop_text],
            "ignore_eos": True,
        },
    )[0]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
    assert out["output_ids"] == long[: long.index(long[position]) + 1]
    assert out["text"] == tokenizer.decode(
        long[: long.index(long[position])]
    )  # trimmed like SGLang


def test_eos_stops_unless_ignored(engine):
    eos = 256
    greedy = generate(
        engine,
        input_ids=[3, 4],
        sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    )[0]
    engine.scheduler.stopper.eos_token_ids.add(greedy["output_ids"][1])  # pretend token 2 is EOS
    try:
        out = generate(
            engine, input_ids=[3, 4], sampling_params={"max_new_tokens": 6, "temperature": 0}
        )[0]
        assert out["output_ids"] == greedy["output_ids"][:2]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    finally:
        engine.scheduler.stopper.eos_token_ids.discard(greedy["output_ids"][1])
        engine.scheduler.stopper.eos_token_ids.add(eos)


def test_n_samples_and_seeds(engine):
    params = {"max_new_tokens": 8, "n": 3, "sampling_seed": 11, "ignore_eos": True}
    first = generate(engine, input_ids=[1, 2], sampling_params=params, rid="abc")
    again = generate(engine, input_ids=[1, 2], sampling_params=params)
    assert [o["output_ids"] for o in first] == [o["output_ids"] for o in again]
    assert len({tuple(o["output_ids"]) for o in first}) > 1  # seeds differ per sample
    assert [o["meta_info"]["id"] for o in first] == ["abc-0", "abc-1", "abc-2"]


def test_prompt_logprobs_are_teacher_forced_from_logprob_start_len(engine, tiny_model):
    ids = [3, 17, 200, 5, 5, 64]
    expected = teacher_forced_logprobs(tiny_model, ids[:1], ids[1:])
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    whole = generate(engine, **body, logprob_start_len=0)[0]
    entries = whole["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids and entries[0][0] is None  # no context for ids[0]
    assert [e[0] for e in entries[1:]] == pytest.approx(expected, abs=1e-4)
    tail = generate(engine, **body, logprob_start_len=4)[0]["meta_info"]["input_token_logprobs"]
    assert [e[0] for e in tail] == pytest.approx(expected[3:], abs=1e-4)
    assert "input_token_logprobs" not in generate(engine, **body)[0]["meta_info"]  # SGLang's -1
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.make_requests(body | {"logprob_start_len": 6})
    # a batch of ragged sequences is scored in one right-padded forward, each as alone
    rows = [[9, 1, 4], ids, [7, 7]]
    outs = generate(engine, **body | {"input_ids": rows}, logprob_start_len=0)
    for row, out in zip(rows, outs, strict=True):
        got = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
        assert got == pytest.approx(teacher_forced_logprobs(tiny_model, row[:1], row[1:]), abs=1e-4)


def test_zero_max_new_tokens_and_bad_params(engine):
    out = generate(engine, input_ids=[1], sampling_params={"max_new_tokens": 0})[0]
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    with pytest.raises(ValueError, match="unsupported sampling_params"):
        engine.make_requests({"input_ids": [1], "sampling_params": {"beam_width": 2}})
    with pytest.raises(ValueError, match="top_p"):
        engine.make_requests({"input_ids": [1], "sampling_params": {"top_p": 0}})


def _start_long(engine, rid, results):
    body = {
        "input_ids": [1, 2, 3],
        "rid": rid,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0},
    }

    def target():
        results[rid] = generate(engine, **body)[0]

    thread = threading.Thread(target=target)
    thread.start()
    return thread


def _num_tokens(engine, rid) -> int | None:
    """Tokens request ``rid`` has, read on the scheduler thread between two rounds (a
    running row's newest tokens are in the row table until it finishes); None when it is
    neither running nor waiting."""

    def count():
        scheduler = engine.scheduler
        for row, request in enumerate(scheduler._running):
            if request.rid == rid:
                return int(scheduler._table.lengths[row])
        waiting = [r for r in scheduler._waiting if r.rid == rid]
        return len(waiting[0].output_ids) if waiting else None

    return engine.scheduler.call(count).result(10)


def _wait_tokens(engine, rid, count=5):
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (_num_tokens(engine, rid) or 0) >= count:
            return
        time.sleep(0.01)
    raise TimeoutError("no tokens generated")


def test_abort_returns_partial_output(engine, tiny_model):
    results = {}
    thread = _start_long(engine, "long", results)
    _wait_tokens(engine, "long")
    engine.scheduler.abort("long")
    thread.join(30)
    out = results["long"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 5 <= len(out["output_ids"]) < 2000
    expected = teacher_forced_logprobs(tiny_model, [1, 2, 3], out["output_ids"])
    assert logprobs_of(out) == pytest.approx(expected, abs=1e-4)


def test_pause_retract_then_continue_gives_the_uninterrupted_output(engine):
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True},
    }
    reference = generate(engine, **body)[0]["output_ids"]
    for mode in ("retract", "in_place"):
        results = {}
        thread = _start_long(engine, mode, results)
        _wait_tokens(engine, mode)
        assert engine.scheduler.pause(mode).result(10) == 1
        produced = _num_tokens(engine, mode)
        assert produced >= 5
        threading.Event().wait(0.2)
        assert _num_tokens(engine, mode) == produced  # paused: nothing generated
        engine.scheduler.resume().result(10)
        _wait_tokens(engine, mode, 40)
        engine.scheduler.abort(mode)
        thread.join(30)
        assert results[mode]["output_ids"][:30] == reference


def test_a_failing_step_aborts_the_batch_instead_of_hanging(engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.scheduler.runner, "decode", broken)
    out = generate(
        engine, input_ids=[[1, 2], [3]], sampling_params={"max_new_tokens": 5, "ignore_eos": True}
    )
    assert [o["meta_info"]["finish_reason"]["type"] for o in out] == ["abort", "abort"]
    assert "device lost" in out[0]["meta_info"]["finish_reason"]["message"]
    monkeypatch.undo()
    again = generate(
        engine, input_ids=[1, 2], sampling_params={"max_new_tokens": 3, "ignore_eos": True}
    )
    assert len(again[0]["output_ids"]) == 3  # the engine keeps serving


def test_a_weight_update_reaches_the_decode_step(engine, tiny_model):
    """The static runner decodes with fused q/k/v and gate/up tensors (the projections are
    slices of them): an update must land in them, so log-probs follow a teacher-forced
    forward of the new weights."""
    import copy

    updated = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for name, param in updated.named_parameters():
            if name.endswith(("k_proj.weight", "v_proj.bias", "up_proj.weight")):
                param.mul_(1.5)
    named = list(updated.state_dict().items())
    original = [(k, v.clone()) for k, v in engine.model.state_dict().items()]
    prompts = [[1, 2, 3], [9] * 7]
    params = {"max_new_tokens": 6, "ignore_eos": True}
    try:
        engine.scheduler.call(lambda: engine.apply_update(named, {})).result(30)
        outs = generate(engine, input_ids=prompts, sampling_params=params, return_logprob=True)
    finally:
        engine.scheduler.call(lambda: engine.apply_update(original, {})).result(30)
    for prompt, out in zip(prompts, outs, strict=True):
        expected = teacher_forced_logprobs(updated, prompt, out["output_ids"])
        assert logprobs_of(out) == pytest.approx(expected, abs=1e-4)
        stale = teacher_forced_logprobs(tiny_model, prompt, out["output_ids"])
        assert logprobs_of(out) != pytest.approx(stale, abs=1e-3)


def test_a_kept_bucket_keeps_its_copy_plan_until_the_parameters_move(engine, tiny_model):
    """Updates through one kept send buffer reuse the engine's copy plan (no per-tensor
    lookup) and still land every new value; once the parameters may have moved (a memory
    resume) the plan is made again."""
    from rl_sglang.engine.weights import HeldBuffers
    from rl_sglang.transports import SendBuffer, dump_payload

    held, buffer = HeldBuffers(), SendBuffer()
    original = [(k, v.clone()) for k, v in engine.model.state_dict().items()]

    def update(scale):
        named = [(k, v * scale) for k, v in tiny_model.state_dict().items()]
        kept = held.named_tensors([dump_payload(buffer.fill(named))], "flattened_bucket")
        engine.scheduler.call(lambda: engine.apply_update(kept, {})).result(30)
        for name, tensor in named:
            assert torch.equal(engine.model.state_dict()[name], tensor), name
        return kept

    try:
        first = update(1.5)
        plan = first.plan
        assert plan is not None and update(0.5) is first and first.plan is plan
        engine.scheduler.call(engine.resume_memory).result(30)
        assert update(2.0).plan is not plan
    finally:
        engine.scheduler.call(lambda: engine.apply_update(original, {})).result(30)


def test_a_drained_batch_logs_where_its_time_went(engine, caplog):
    """Once the running batch drains, one log line tells its requests, prefills and decode
    rounds, and the thread's seconds per activity, which add up to at most its wall time."""
    import re
    import time

    params = {"max_new_tokens": 5, "ignore_eos": True}
    with caplog.at_level("INFO", logger="rl_sglang.engine.scheduler"):
        generate(engine, input_ids=[[1, 2, 3], [4, 5]], sampling_params=params)
        deadline = time.monotonic() + 10  # the answers resolve before the thread logs
        while engine.scheduler.times.started is not None and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if "batch drained" in r.getMessage()]
    assert len(lines) == 1, lines
    numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", lines[0])]
    requests, wall, prefills, prefill, rounds, launch, wait, bookkeeping, other, *cpu = numbers
    assert requests == 2 and prefills >= 1 and rounds >= 4  # 5 tokens: 1 from the prefill
    # five values printed to the millisecond, each rounded by up to 0.5 ms
    assert prefill + launch + wait + bookkeeping <= wall + 2.5e-3 and other >= 0
    thread_cpu, process_cpu = cpu  # the scheduler thread's CPU is part of the process's
    assert 0 < thread_cpu <= process_cpu + 1e-3
    assert engine.scheduler.times.started is None  # reset for the next batch


def test_an_abort_resolves_once_applied_and_spares_later_requests(engine):
    """The abort's Future resolves only once the scheduler thread has applied it, so a
    request submitted after that is not hit by it (an abort left queued would abort it)."""
    import threading

    held, release = threading.Event(), threading.Event()
    engine.scheduler.call(lambda: (held.set(), release.wait(10)))
    assert held.wait(10)
    applied = engine.scheduler.abort(None)  # queued behind the task holding the thread
    assert not applied.done()
    release.set()
    applied.result(10)
    out = generate(
        engine, input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 4, "ignore_eos": True}
    )
    assert out[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(out[0]["output_ids"]) == 4


def test_a_row_stopping_while_the_next_step_is_queued(engine):
    """The scheduler queues step k + 1 before reading step k: a row that a stop token ends
    at step k must lose its extra token, and its batch mate must not notice."""
    greedy = {"max_new_tokens": 16, "temperature": 0}
    alone_a, alone_b = (
        generate(engine, input_ids=prompt, sampling_params=greedy)[0]["output_ids"]
        for prompt in ([4, 5, 6], [70, 71])
    )
    cut = next(i for i in range(3, len(alone_a)) if alone_a[i] not in alone_a[:i])
    stop_a = {**greedy, "stop_token_ids": [alone_a[cut]]}
    out_a, out_b = generate(
        engine, input_ids=[[4, 5, 6], [70, 71]], sampling_params=[stop_a, greedy]
    )
    assert out_a["output_ids"] == alone_a[: cut + 1]
    assert out_a["meta_info"]["finish_reason"] == {"type": "stop", "matched": alone_a[cut]}
    assert out_b["output_ids"] == alone_b


@pytest.mark.slow
def test_compiled_static_runner_matches_teacher_forcing(tiny_dir, tiny_model):
    """``compile=True``: one torch.compile of the decoder layer serves every layer; its
    log-probs still equal a teacher-forced forward (eager on CPU, graphs on GPU)."""
    model, tokenizer = load_model(str(tiny_dir))
    engine = Engine(
        model, tokenizer, max_batch_size=4, runner="static", max_context=256, compile=True
    )
    prompts = [[1, 2, 3], [9] * 11, [5]]
    try:
        outs = generate(
            engine,
            input_ids=prompts,
            return_logprob=True,
            sampling_params={"max_new_tokens": 6, "ignore_eos": True},
        )
    finally:
        engine.scheduler.stop()
    assert engine.scheduler.runner.compiled
    for prompt, out in zip(prompts, outs, strict=True):
        expected = teacher_forced_logprobs(tiny_model, prompt, out["output_ids"])
        assert logprobs_of(out) == pytest.approx(expected, abs=1e-4)


def test_staggered_finishes_and_joins_keep_each_rows_cache(engine, tiny_model):
    """Rows finish at different steps (their slots are compacted) while waiting prompts
    join; every row's log-probs still follow its own teacher-forced forward."""
    prompts = [[1, 2, 3], [9] * 11, [5], [7, 8], [100, 101, 102, 103, 104], [42] * 4]
    budgets = [3, 9, 5, 12, 4, 7]
    params = [{"max_new_tokens": n, "ignore_eos": True} for n in budgets]
    outs = generate(engine, input_ids=prompts, sampling_params=params, return_logprob=True)
    for prompt, budget, out in zip(prompts, budgets, outs, strict=True):
        assert len(out["output_ids"]) == budget
        expected = teacher_forced_logprobs(tiny_model, prompt, out["output_ids"])
        assert logprobs_of(out) == pytest.approx(expected, abs=1e-4)


def test_updates_follow_parameters_that_moved_during_a_release(engine):
    """The engine keeps the state_dict it copies updates into; a release/resume (on a GPU:
    weights to host and back, new storage) must not leave it writing into old storage."""
    head = engine.model.lm_head.weight
    before = head.detach().clone()
    call = engine.scheduler.call
    try:
        call(lambda: engine.apply_update([("lm_head.weight", before + 1.0)], {})).result(30)
        engine.release_memory()
        head.data = head.data.clone()  # what model.to() does to every parameter
        engine.resume_memory()
        call(lambda: engine.apply_update([("lm_head.weight", before + 2.0)], {})).result(30)
        torch.testing.assert_close(engine.model.lm_head.weight.detach(), before + 2.0)
    finally:
        call(lambda: engine.apply_update([("lm_head.weight", before)], {})).result(30)


def test_the_runner_choice_names_why_a_model_cannot_take_the_static_path(caplog):
    from types import SimpleNamespace

    from rl_sglang.engine.core import choose_runner
    from rl_sglang.engine.static import static_unsupported_reason

    def fake(on_cuda: bool, **config):
        shape = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
        settings = {"model_type": "llama", "hidden_act": "silu", **shape, **config}
        param = SimpleNamespace(is_cuda=on_cuda, element_size=lambda: 4)
        return SimpleNamespace(config=SimpleNamespace(**settings), parameters=lambda: iter([param]))

    assert static_unsupported_reason(fake(True)) is None
    assert "gelu" in static_unsupported_reason(fake(True, hidden_act="gelu"))
    assert choose_runner("auto", fake(True)) == "static"
    # CPU: static only while its slot cache is small (2 layers x 4 heads x 16 dims x 2 x 4 B
    # = 1 KiB a token: 64 slots of 64 tokens take 4 MiB); nothing to say either way
    assert choose_runner("auto", fake(False), max_context=64, max_slots=64) == "static"
    assert choose_runner("auto", fake(False), max_context=8192, max_slots=64) == "dynamic"
    assert choose_runner("auto", fake(False)) == "dynamic"  # unbounded context
    assert choose_runner("auto", fake(False, model_type="gemma"), 64, 64) == "dynamic"
    assert not caplog.records
    with caplog.at_level("WARNING"):
        assert choose_runner("auto", fake(True, model_type="gemma")) == "dynamic"
    assert "'gemma'" in caplog.text and "without CUDA graphs" in caplog.text
    with pytest.raises(ValueError, match="sliding-window"):
        choose_runner("static", fake(True, use_sliding_window=True))


def test_a_released_static_runner_frees_its_tensors_and_resumes_with_the_same_outputs(
    tiny_dir, tiny_model
):
    """What the engine's memory release does to a static runner (on GPU, between the two
    the model leaves the device): caches and fused weights are dropped, the compiled step is
    kept, and after the resume greedy outputs and log-probs are what they were."""
    model, tokenizer = load_model(str(tiny_dir))
    engine = Engine(model, tokenizer, max_batch_size=4, runner="static", max_context=64)
    runner = engine.scheduler.runner
    body = {
        "input_ids": [[1, 2, 3], [9] * 7],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
    }
    try:
        before = generate(engine, **body)
        layer_fn = runner.layer_fn
        engine.scheduler.call(runner.release).result()
        assert runner.keys is None and runner.layers is None and runner.graphs is None
        engine.scheduler.call(runner.resume).result()
        after = generate(engine, **body)
    finally:
        engine.scheduler.stop()
    assert runner.layer_fn is layer_fn and len(runner.keys) == model.config.num_hidden_layers
    assert [o["output_ids"] for o in after] == [o["output_ids"] for o in before]
    for out_a, out_b in zip(after, before, strict=True):
        assert logprobs_of(out_a) == pytest.approx(logprobs_of(out_b), abs=1e-6)
