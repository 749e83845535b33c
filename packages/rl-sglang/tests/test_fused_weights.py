"""The static runner's fused q/k/v and gate/up tensors hold the projections themselves: each
Linear's weight and bias is a row slice of its group's tensor, so a weight update lands in
the tensors the decode step reads (no refresh) and the engine holds those weights once."""

import asyncio
import copy

import pytest
import torch
from aiohttp import web
from test_engine_memory import HostRegion

from conftest import run
from rl_sglang import transports
from rl_sglang.client import EngineClient
from rl_sglang.embedded import make_app
from rl_sglang.engine.core import Engine
from rl_sglang.engine.layers import fused_groups
from rl_sglang.engine.stable_memory import StableMemory
from rl_sglang.engine.static import StaticRunner
from rl_sglang.tiny import byte_tokenizer, random_model, tiny_config

PROMPTS = [[1, 2, 3], [9] * 7, [200, 17]]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def fused_views(runner: StaticRunner):
    """Per layer and group: the fused tensor and the projection tensors it must hold."""
    for layer, weights in zip(runner.model.model.layers, runner.layers, strict=True):
        fused = (weights.qkv, weights.gate_up)
        for group, (weight, bias) in zip(fused_groups(layer), fused, strict=True):
            yield weight, [m.weight for m in group]
            if bias is not None:  # Qwen2: q/k/v have biases, gate/up none
                yield bias, [m.bias for m in group]


def test_projections_are_row_slices_of_the_fused_tensors():
    model = random_model(tiny_config(), seed=1)
    before = copy.deepcopy(model.state_dict())
    runner = StaticRunner(model, max_slots=2, max_len=64)
    fused_bytes = 0
    for fused, parts in fused_views(runner):
        start, end = fused.data_ptr(), fused.data_ptr() + fused.nbytes
        assert [p.data_ptr() for p in parts] == [
            start + sum(q.nbytes for q in parts[:i]) for i in range(len(parts))
        ]
        assert all(
            p.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr() for p in parts
        )
        assert parts[-1].data_ptr() + parts[-1].nbytes == end
        fused_bytes += fused.nbytes
    assert fused_bytes > 0
    for name, tensor in model.state_dict().items():  # values unchanged by the move
        assert torch.equal(tensor, before[name]), name
    again = StaticRunner(model, max_slots=2, max_len=64)  # fused already: reused, not copied
    assert [f.data_ptr() for f, _ in fused_views(again)] == [
        f.data_ptr() for f, _ in fused_views(runner)
    ]


async def serving(model, body_fn):
    """A static engine serving ``model`` over HTTP on loopback: ``await body_fn(client,
    engine)``."""
    engine = Engine(model, byte_tokenizer(), max_batch_size=4, runner="static", max_context=64)
    app_runner = web.AppRunner(make_app(engine))
    await app_runner.setup()
    site = web.TCPSite(app_runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{app_runner.addresses[0][1]}"
        async with EngineClient(url) as client:
            return await body_fn(client, engine)
    finally:
        await app_runner.cleanup()
        engine.scheduler.stop()


def greedy_tokens(client):
    return client.generate(input_ids=PROMPTS, sampling_params=GREEDY)


def reference_greedy(model) -> list[list[int]]:
    """HF's own greedy decoding of each prompt (the unfused model's forward)."""
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device=model.device)
        with torch.no_grad():
            generated = model.generate(
                ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        out.append(generated[0, len(prompt) :].tolist())
    return out


@pytest.mark.parametrize("kept", [False, True])
def test_an_update_through_the_endpoint_lands_in_the_fused_tensors(kept):
    """Greedy tokens after an update through /update_weights_from_tensor (a flattened
    bucket, kept buffer or fresh) are HF's greedy tokens of the new weights, and the fused
    tensors hold the new q/k/v and gate/up with no refresh step in between."""
    old, new = random_model(tiny_config(), seed=2), random_model(tiny_config(), seed=3)
    named = list(new.state_dict().items())
    buffer = transports.SendBuffer() if kept else None

    async def body(client, engine):
        before = [o["output_ids"] for o in await greedy_tokens(client)]
        for _ in range(2 if kept else 1):  # a kept buffer: the second sync reuses the plan
            await transports.update_from_tensor(
                [client], named, flatten=True, buffer=buffer, weight_version="new"
            )
        after = [o["output_ids"] for o in await greedy_tokens(client)]
        return before, after, engine.scheduler.runner

    before, after, runner = run(serving(copy.deepcopy(old), body))
    if buffer is not None:
        buffer.release()
    assert before == reference_greedy(old)
    assert after == reference_greedy(new) and after != before
    for fused, parts in fused_views(runner):
        assert torch.equal(fused, torch.cat([p.detach() for p in parts]))
    for name, tensor in named:
        assert torch.equal(runner.model.state_dict()[name], tensor), name


def generate_greedy(engine) -> list[list[int]]:
    groups, _ = engine.make_requests({"input_ids": PROMPTS, "sampling_params": GREEDY})

    async def go():
        return [o[0] for o in await asyncio.gather(*(engine.run(g) for g in groups))]

    return [o["output_ids"] for o in asyncio.run(go())]


def release_and_resume(engine) -> None:
    """A colocated turn's memory release and resume. On the CPU the engine frees nothing,
    so the runner's own release (its stable memory: here the host stand-in) is called."""
    call = engine.scheduler.call
    if engine.device.type == "cuda":
        call(engine.release_memory).result(60)
        call(engine.resume_memory).result(60)
    else:
        runner = engine.scheduler.runner
        call(runner.release).result(60)
        call(runner.resume).result(60)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fused_projections_in_stable_memory_keep_an_update_across_a_release(device, monkeypatch):
    """In stable memory the fused tensors (the projections themselves) lie among the kept
    bytes: an update copied into them survives a release and resume, at the same
    addresses, and greedy tokens stay HF's greedy tokens of the new weights. On the CPU a
    host region stands in for CUDA virtual memory (see test_engine_memory)."""
    if device == "cpu":
        monkeypatch.setattr(
            StableMemory, "for_bytes", classmethod(lambda cls, n, device: cls(HostRegion(n)))
        )
    old = random_model(tiny_config(), seed=2).to(device)
    new = random_model(tiny_config(), seed=3).to(device)
    engine = Engine(
        copy.deepcopy(old),
        byte_tokenizer(),
        max_batch_size=4,
        runner="static",
        max_context=64,
        stable_memory=True,
        compile=False,
    )
    runner = engine.scheduler.runner
    try:
        memory = runner.stable
        assert memory is not None, "no address-stable memory on this device"
        kept_start = memory.region.bytes.data_ptr()
        kept_end = kept_start + memory.kept_bytes
        places = [fused.data_ptr() for fused, _ in fused_views(runner)]
        for fused, _ in fused_views(runner):
            assert kept_start <= fused.data_ptr() < fused.data_ptr() + fused.nbytes <= kept_end
        before = generate_greedy(engine)
        named = list(new.state_dict().items())
        engine.scheduler.call(lambda: engine.apply_update(named, {})).result(60)
        updated = generate_greedy(engine)
        release_and_resume(engine)
        resumed = generate_greedy(engine)
        assert [fused.data_ptr() for fused, _ in fused_views(runner)] == places
    finally:
        engine.scheduler.stop()
    assert before == reference_greedy(old) and before != updated
    assert updated == resumed == reference_greedy(new)
