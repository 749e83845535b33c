"""Colocated weight sync into an engine that spans several devices (SGLang tensor parallel):
TP rank j of the engine gets the tensor handles of the training rank on its own device.

Two training ranks' copies of a bucket (filled with the rank's number, so the copies tell
apart) are serialized as each rank does, routed as the sender routes what the ranks'
all-gather returned, and sent to an HTTP engine endpoint (recording_server.py) that opens
every TP rank's payload the way SGLang's TP workers do (``serialized_named_tensors[j]``) and
records what each TP rank read. The collective around it (all-gather, barrier) runs for real
on the GPU machine (test_gpu_backends.py, an SGLang engine of TP size 2).
"""

import asyncio

import pytest
import torch
from recording_server import RecordingServer

from rl_launcher.infra.placement import plan_layout
from rl_launcher.infra.weight_sync import engine_tp_ranks, payloads_of_sender
from rl_sglang.client import EngineClient
from rl_sglang.engine.weights import deserialize_bucket
from rl_sglang.transports import send_payloads, serialize_bucket


async def open_per_tp_rank(body: dict, _request) -> tuple[dict, dict]:
    """``/update_weights_from_tensor`` of a TP engine: item j of the payload list is opened
    by TP rank j; each rank's first value is recorded."""
    per_rank = [deserialize_bucket(p) for p in body["serialized_named_tensors"]]
    record = {
        "version": body.get("weight_version"),
        "values": [{name: t.flatten()[0].item() for name, t in b} for b in per_rank],
    }
    return record, {"success": True, "message": "ok"}


def colocated_tp_two() -> dict:
    plan = plan_layout(
        num_nodes=1, devices_per_node=2, num_engines=1, devices_per_engine=2, colocate=True
    )
    return {
        "transport": "tensor",
        "flatten": False,
        "tp_size": 2,
        "senders": [0],
        "tp_ranks": engine_tp_ranks(plan.engine_bundles, plan.train_bundles),
    }


def test_an_engine_over_two_devices_maps_its_tp_ranks_to_the_colocated_training_ranks():
    plan = plan_layout(
        num_nodes=1, devices_per_node=4, num_engines=2, devices_per_engine=2, colocate=True
    )
    assert engine_tp_ranks(plan.engine_bundles, plan.train_bundles) == [[0, 1], [2, 3]]
    fewer_ranks = plan_layout(
        num_nodes=1,
        devices_per_node=4,
        num_engines=1,
        devices_per_engine=4,
        colocate=True,
        num_train_ranks=2,
    )
    assert engine_tp_ranks(fewer_ranks.engine_bundles, fewer_ranks.train_bundles) == []


def shared_buckets(names_by_rank: list[list[str]]) -> tuple[list, list]:
    """What each rank's all-gather returns: every rank's (payload, names), rank r's tensors
    filled with r; and the storage to keep alive while the engine opens them."""
    shared, keep_alive = [], []
    for rank, names in enumerate(names_by_rank):
        bucket = [(name, torch.full((4,), float(rank))) for name in names]
        payload, alive = serialize_bucket(bucket)
        shared.append((payload, names))
        keep_alive.append(alive)
    return shared, keep_alive


def test_each_tp_rank_opens_the_copy_of_the_rank_on_its_device():
    how = colocated_tp_two()
    assert how["tp_ranks"] == [[0, 1]]
    shared, _keep_alive = shared_buckets([["w.a", "w.b"], ["w.a", "w.b"]])
    with RecordingServer("/update_weights_from_tensor", open_per_tp_rank) as engine:
        assert payloads_of_sender(shared, [engine.url], how["tp_ranks"], rank=1) == {}
        mine = payloads_of_sender(shared, [engine.url], how["tp_ranks"], rank=0)
        assert list(mine) == [engine.url]

        async def send():
            async with EngineClient(engine.url) as client:
                return await send_payloads([client], list(mine.values()), weight_version="3")

        asyncio.run(send())
    assert engine.seen == [
        {"version": "3", "values": [{"w.a": 0.0, "w.b": 0.0}, {"w.a": 1.0, "w.b": 1.0}]}
    ]


def test_ranks_holding_different_buckets_are_refused():
    shared, _ = shared_buckets([["w.a", "w.b"], ["w.c"]])  # as pipeline stages would
    with pytest.raises(RuntimeError, match="same bucket on every training rank"):
        payloads_of_sender(shared, ["http://127.0.0.1:1"], [[0, 1]], rank=0)
