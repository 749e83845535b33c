"""Colocated tensor sync through kept send buffers (``engine.weight_buffer: kept``): a
training rank streams its buckets through two buffers, packing bucket k+1 while the
engine applies bucket k, and refills a buffer only once the engine has answered for it.

The engine here is an HTTP endpoint (real aiohttp, real payloads) that opens each payload,
takes its time "applying" it, then reads what the buffer holds: a buffer refilled too
early would show the next bucket's values."""

import asyncio
import time

import torch
from recording_server import RecordingServer

from rl_launcher.infra.weight_sync import EngineWeightSync, kept_buffers
from rl_sglang.engine.weights import named_tensors_from_payload

APPLY_S = 0.2  # the endpoint's time per bucket


async def apply_slowly(body: dict, _request) -> tuple[dict, dict]:
    """``/update_weights_from_tensor`` of a slow engine: opens the payload, sleeps, then
    records the bucket's names and values as it reads them after the sleep."""
    received = time.perf_counter()
    named = named_tensors_from_payload(body["serialized_named_tensors"], body["load_format"])
    await asyncio.sleep(APPLY_S)
    values = {name: t.clone() for name, t in named}
    record = {"values": values, "received": received, "answered": time.perf_counter()}
    return record, {"success": True, "weight_version": body["weight_version"]}


def slow_engine() -> RecordingServer:
    return RecordingServer("/update_weights_from_tensor", apply_slowly)


def buckets(num: int, made_at: list[float]):
    """``num`` buckets of the same layout, bucket k filled with k (its values tell which
    bucket a buffer holds); ``made_at[k]``: when bucket k was handed out."""
    for k in range(num):
        made_at.append(time.perf_counter())
        yield [("w", torch.full((64, 32), float(k))), ("b", torch.full((32,), float(k)))]


HOW = {"transport": "tensor", "flatten": True, "buffer": "kept", "tp_size": 1, "senders": [0]}


def test_kept_buffers_stream_buckets_through_two_slots():
    with slow_engine() as engine:
        sync, made_at = EngineWeightSync(0), []
        sent = sync.sync(buckets(5, made_at), [engine.url], "v1", HOW)
        assert sent == 5 * (64 * 32 + 32) * 4
        applied = [{n: t.unique().tolist() for n, t in s["values"].items()} for s in engine.seen]
        assert applied == [{"w": [k], "b": [k]} for k in range(5)]
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


class StateMover:
    """A backend's offload and onload (moving its own training state), which this test
    does not look at: only what the training rank does with its send buffers."""

    def offload(self) -> None:
        pass

    def onload(self) -> None:
        pass


def test_an_offloaded_rank_keeps_its_send_buffers_for_the_next_sync():
    """A colocated turn (offload, onload) between two syncs leaves the kept buffer where it
    was: the second sync allocates nothing and hands the engine the same storage, whose
    handle the engine still holds open."""
    from rl_launcher.roles.train_group import TrainWorker

    worker = TrainWorker(0, 1, spec=None, run_spans_nodes=False)
    worker.backend, worker.weights = StateMover(), EngineWeightSync(0)
    with slow_engine() as engine:
        worker.weights.sync(buckets(1, []), [engine.url], "v1", HOW)
        storage = worker.weights.buffers[0].storage.data_ptr()
        worker.offload()
        worker.onload()
        worker.weights.sync(buckets(1, []), [engine.url], "v2", HOW)
    assert [b.num_allocations for b in worker.weights.buffers] == [1]
    assert worker.weights.buffers[0].storage.data_ptr() == storage
    worker.weights.release_buffers()
