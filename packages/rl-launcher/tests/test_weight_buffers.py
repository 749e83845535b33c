"""Colocated tensor sync through kept send buffers (``engine.weight_buffer: kept``): a
training rank streams its buckets through two buffers, packing bucket k+1 while the
engine applies bucket k, and refills a buffer only once the engine has answered for it.

The engine here is an HTTP endpoint (real aiohttp, real payloads) that opens each payload,
takes its time "applying" it, then reads what the buffer holds: a buffer refilled too
early would show the next bucket's values."""

import asyncio
import threading
import time

import torch
from aiohttp import web

from rl_core.distributed import free_port
from rl_launcher.infra.weight_sync import EngineWeightSync, kept_buffers
from rl_sglang.engine.weights import named_tensors_from_payload

APPLY_S = 0.2  # the endpoint's time per bucket


class SlowEngine:
    """``POST /update_weights_from_tensor``: opens the payload, sleeps, then records the
    bucket's names and values as it reads them after the sleep."""

    def __init__(self):
        self.seen: list[dict] = []
        self.port = free_port()
        self._ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _update(self, request):
        body = await request.json()
        received = time.perf_counter()
        named = named_tensors_from_payload(body["serialized_named_tensors"], body["load_format"])
        await asyncio.sleep(APPLY_S)
        values = {name: t.clone() for name, t in named}
        self.seen.append({"values": values, "received": received, "answered": time.perf_counter()})
        return web.json_response({"success": True, "weight_version": body["weight_version"]})

    def _serve(self):
        loop = asyncio.new_event_loop()
        app = web.Application(client_max_size=1 << 26)
        app.router.add_post("/update_weights_from_tensor", self._update)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        loop.run_forever()


def buckets(num: int, made_at: list[float]):
    """``num`` buckets of the same layout, bucket k filled with k (its values tell which
    bucket a buffer holds); ``made_at[k]``: when bucket k was handed out."""
    for k in range(num):
        made_at.append(time.perf_counter())
        yield [("w", torch.full((64, 32), float(k))), ("b", torch.full((32,), float(k)))]


HOW = {"transport": "tensor", "flatten": True, "buffer": "kept", "tp_size": 1, "senders": [0]}


def test_kept_buffers_stream_buckets_through_two_slots():
    engine, sync, made_at = SlowEngine(), EngineWeightSync(0), []
    sent = sync.sync(buckets(5, made_at), [engine.url], "v1", HOW)
    assert sent == 5 * (64 * 32 + 32) * 4
    assert [s["values"]["w"].unique().tolist() for s in engine.seen] == [[k] for k in range(5)]
    assert [s["values"]["b"].unique().tolist() for s in engine.seen] == [[k] for k in range(5)]
    # bucket k+1 was made and packed before the engine answered for bucket k (serially,
    # it would be made after), and sent after that answer
    for k in range(4):
        assert made_at[k + 1] < engine.seen[k]["answered"] < engine.seen[k + 1]["received"]
    assert [b.num_allocations for b in sync.buffers] == [1, 1]
    again = sync.sync(buckets(3, []), [engine.url], "v2", HOW)  # the next sync: same buffers
    assert again and [b.num_allocations for b in sync.buffers] == [1, 1]
    assert engine.seen[-1]["values"]["w"].unique().tolist() == [2]
    sync.release_buffers()
    assert [b.nbytes for b in sync.buffers] == [0, 0]


def test_only_flattened_tensor_sync_keeps_buffers():
    assert kept_buffers(HOW)
    assert not kept_buffers(HOW | {"buffer": "fresh"})
    assert not kept_buffers(HOW | {"flatten": False})
    assert not kept_buffers(HOW | {"transport": "distributed"})
