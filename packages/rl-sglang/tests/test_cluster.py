"""Two embedded engines behind the real sglang-router: many concurrent clients, abort
mid-generation, pause/continue, adding and removing workers, a killed engine restarted."""

import asyncio

import pytest

from conftest import run, teacher_forced_logprobs
from rl_sglang.client import EngineClient, EngineError
from rl_sglang.process import EmbeddedEngine

pytestmark = pytest.mark.integration
LONG = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}


def finished_counts(cluster):
    async def go():
        infos = []
        for url in cluster.engine_urls:
            async with EngineClient(url) as client:
                infos.append((await client.server_info())["internal_states"][0]["num_finished"])
        return infos

    return run(go())


def test_concurrent_clients_through_the_router(cluster, tiny_model):
    before = finished_counts(cluster)

    async def one_client(index):
        async with EngineClient(cluster.router.url) as client:
            prompt = [index + 1, 7, 9]
            out = await client.generate(
                input_ids=prompt,
                return_logprob=True,
                sampling_params={"max_new_tokens": 6, "ignore_eos": True},
            )
            return prompt, out

    async def all_clients():
        return await asyncio.gather(*(one_client(i) for i in range(24)))

    results = run(all_clients())
    for prompt, out in results:
        logprobs = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        assert logprobs == pytest.approx(
            teacher_forced_logprobs(tiny_model, prompt, out["output_ids"]), abs=1e-4
        )
    after = finished_counts(cluster)
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(served) == 24 and min(served) >= 6  # round robin used both engines


def _start_long(cluster, engine_index, rid):
    client = EngineClient(cluster.engine_urls[engine_index])
    task = asyncio.ensure_future(
        client.generate(input_ids=[1, 2, 3], rid=rid, return_logprob=True, sampling_params=LONG)
    )
    return client, task


async def _wait_running(client, count=1):
    for _ in range(300):
        if (await client.server_info())["internal_states"][0]["num_running"] >= count:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("request never started")


def test_client_prompt_logprobs_through_the_router(cluster, tiny_model):
    """What a distillation teacher answers: the log-prob of every id after the first."""
    ids = [[9, 1, 4, 4, 250, 3], [7, 7]]

    async def go():
        async with EngineClient(cluster.router.url) as client:
            alone = await asyncio.gather(*(client.prompt_logprobs(row) for row in ids))
            return alone, await client.prompt_logprobs_batch(ids)

    alone, batched = run(go())
    for row, logprobs, in_batch in zip(ids, alone, batched, strict=True):
        assert in_batch == pytest.approx(logprobs, abs=1e-5)
        assert logprobs == pytest.approx(
            teacher_forced_logprobs(tiny_model, row[:1], row[1:]), abs=1e-4
        )


def test_abort_mid_generation_returns_the_partial_response(cluster, tiny_model):
    async def go():
        client, task = _start_long(cluster, 0, "to-abort")
        await _wait_running(client)
        await asyncio.sleep(0.3)
        await client.abort("to-abort")
        out = await asyncio.wait_for(task, 30)
        await client.close()
        return out

    out = run(go())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < LONG["max_new_tokens"]
    logprobs = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    assert logprobs == pytest.approx(
        teacher_forced_logprobs(tiny_model, [1, 2, 3], out["output_ids"]), abs=1e-4
    )


def test_pause_in_place_and_continue(cluster):
    async def go():
        client, task = _start_long(cluster, 1, "paused")
        await _wait_running(client)
        paused = await client.pause(mode="in_place")
        assert paused["num_paused_requests"] == 1
        info = await client.server_info()
        await asyncio.sleep(0.5)
        assert not task.done() and info["paused"]
        await client.resume()
        await asyncio.sleep(0.3)
        await client.abort("paused")
        out = await asyncio.wait_for(task, 30)
        await client.close()
        return out

    out = run(go())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"


def test_pause_abort_mode_aborts_in_flight_then_generation_resumes(cluster):
    async def go():
        client, task = _start_long(cluster, 0, "pause-abort")
        await _wait_running(client)
        await client.pause()  # SGLang's default mode aborts
        out = await asyncio.wait_for(task, 30)
        await client.resume()
        again = await client.generate(
            input_ids=[5], sampling_params={"max_new_tokens": 3, "ignore_eos": True}
        )
        await client.close()
        return out, again

    out, again = run(go())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(again["output_ids"]) == 3


def test_add_and_remove_worker_at_runtime(cluster, tiny_dir, tmp_path):
    extra = EmbeddedEngine(tiny_dir, log_dir=tmp_path).start()
    try:
        cluster.router.add_worker(extra.url)
        assert extra.url in cluster.router.worker_urls(healthy_only=True)
        cluster.router.remove_worker(extra.url)
        assert extra.url not in cluster.router.worker_urls()
        assert "smg_" in cluster.router.metrics() or "sgl_" in cluster.router.metrics()
    finally:
        extra.stop()
    with pytest.raises(ValueError, match="not a worker"):
        cluster.router.remove_worker(extra.url)


def wait_router_marks_unhealthy(router, url, timeout_s=30.0):
    import time

    deadline = time.monotonic() + timeout_s
    while url in router.worker_urls(healthy_only=True):
        assert time.monotonic() < deadline, f"router still routes to dead {url}"
        time.sleep(0.2)


def test_killed_engine_is_detected_restarted_and_requests_retried(cluster):
    victim = cluster.engines[1]

    async def in_flight():
        async with EngineClient(victim.url, retries=8, backoff_s=1.0) as client:
            return await client.generate(
                input_ids=[4, 4], sampling_params={"max_new_tokens": 400, "ignore_eos": True}
            )

    async def go():
        task = asyncio.ensure_future(in_flight())
        async with EngineClient(victim.url) as probe:
            await _wait_running(probe)
        victim.kill()
        async with EngineClient(victim.url) as probe:
            assert not await probe.health()
        await asyncio.to_thread(wait_router_marks_unhealthy, cluster.router, victim.url)
        await asyncio.to_thread(victim.restart)
        return await asyncio.wait_for(task, 120)

    out = run(go())
    assert len(out["output_ids"]) == 400 and victim.healthy()
    cluster.router.wait_for_workers(cluster.engine_urls, timeout_s=60)


def test_bad_requests_are_400_with_a_message(cluster):
    async def go():
        async with EngineClient(cluster.engine_urls[0]) as client:
            with pytest.raises(EngineError, match="unsupported sampling_params") as info:
                await client.generate(input_ids=[1], sampling_params={"beam": 2})
            assert info.value.status == 400

    run(go())


def test_streaming_health_and_info_endpoints(cluster, tiny_dir):
    async def go():
        async with EngineClient(cluster.engine_urls[0]) as client:
            chunks = [
                c
                async for c in client.generate_stream(
                    input_ids=[1, 2], sampling_params={"max_new_tokens": 4, "ignore_eos": True}
                )
            ]
            await client.health_generate()
            await client.flush_cache()
            frozen = await client.freeze_gc()
            return (
                chunks,
                await client.model_info(),
                await client.request("GET", "/model_info"),
                frozen,
            )

    chunks, info, alias, frozen = run(go())
    assert int(frozen.split(":")[1].split()[0]) > 10_000  # the model, tokenizer, aiohttp, ...
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 4]  # cumulative, then final
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert info == alias and info["model_path"] == str(tiny_dir) and info["is_generation"]
