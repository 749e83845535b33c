"""``rollout.data_plane: workers`` in the asynchronous loop: a group that a weight update
pauses mid-generation is held by the rollout worker that generated it and resumed by that
worker in the next chunk, neither lost, repeated nor labelled with the wrong version.

Real parts: two rollout workers (Ray actors, on the module's local Ray), the rollout
manager, the asynchronous producer, and an engine speaking SGLang's HTTP API (the
simulated engine's routes) whose answers are scripted, so the order of events is forced,
not timed: draw 1's first requests are held by the engine until it is paused, so the
weight update lands while that group is in flight; everything else is answered at once.
Each answered token says which weights made it (id ``TOKEN[version]``, log-prob
``-1 - version``), so the stored rows show which part of a response came from which
version."""

import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from test_over_sampling import Prompts
from test_train_loop import ROOT, shrunk

from rl_launcher.config.loader import load_config
from rl_launcher.roles.async_rollout import ContinuousRollout
from rl_launcher.roles.rollout_manager import RolloutManager
from rl_launcher.roles.rollout_workers import WorkerRollout, start_rollout_workers
from rl_launcher.session.model import load_tokenizer
from rl_launcher.simulated.engine import SimEngineState, SimModel, make_app

pytestmark = pytest.mark.integration
TOKENIZER = ROOT / "examples/quickstart/tokenizer"
HELD_DRAW = 1  # its first requests wait at the engine until the pause aborts them
TOKEN = {"0": 5, "1": 6}  # the token id each weight version answers with
MAX_NEW_TOKENS, PARTIAL = 4, 2  # a held request is aborted after PARTIAL tokens
GROUP_SIZE = 2


class ScriptedEngineState(SimEngineState):
    """The simulated engine's state with scripted answers (module docstring); ``log``:
    one ``(draw, input ids, max_new_tokens, version, finish)`` per answered output."""

    def __init__(self):
        super().__init__(SimModel(), index=0)
        self.log: list[tuple] = []
        self.waiting: set[str] = set()  # rids held until aborted

    async def one_output(self, prompt_ids: list[int], params: dict, logprob: bool) -> dict:
        await self.resumed.wait()  # a paused engine holds new requests, as SGLang does
        rid, stop = f"scripted-{self.num_requests}", asyncio.Event()
        self.num_requests += 1
        budget = int(params["max_new_tokens"])
        made, finish = budget, {"type": "stop", "matched": 0}
        if prompt_ids[0] == HELD_DRAW and self.weight_version == "0":
            self.in_flight[rid] = stop
            self.waiting.add(rid)
            await stop.wait()  # pause_generation aborts it
            del self.in_flight[rid]
            self.waiting.discard(rid)
            made, finish = PARTIAL, {"type": "abort", "message": "paused"}
        version = self.weight_version
        self.log.append((prompt_ids[0], list(prompt_ids), budget, version, finish["type"]))
        ids = [TOKEN[version]] * made
        meta = {"id": rid, "finish_reason": finish, "weight_version": version}
        meta["output_token_logprobs"] = [[-1.0 - int(version), t, None] for t in ids]
        return {"text": "", "output_ids": ids, "meta_info": meta}


class ScriptedEngine:
    """``ScriptedEngineState`` served on 127.0.0.1 from a thread of its own; shaped as an
    engine pool's server (``url``, ``wait_ready``, ``stop``)."""

    def __init__(self):
        from aiohttp import web

        self.state_ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def serve():
            self.state = ScriptedEngineState()
            self.runner = web.AppRunner(make_app(self.state), access_log=None)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", 0).start()
            return self.runner.addresses[0][1]

        port = asyncio.run_coroutine_threadsafe(serve(), self.loop).result(timeout=10)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout_s=None) -> None:
        """Serving since the constructor returned."""

    def answered(self, draw: int, version: str) -> int:
        return sum(1 for d, _, _, v, _ in self.state.log if (d, v) == (draw, version))

    def wait_for(self, condition, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"engine log: {self.state.log}"
            time.sleep(0.05)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def two_worker_manager(tmp_path, engine: ScriptedEngine, partial: bool) -> RolloutManager:
    """The rollout manager of a workers-plane async run over ``engine``, with two rollout
    workers (one per node, as two nodes with engines would have)."""
    config, _ = load_config(
        shrunk(
            tmp_path / "run",
            *("--rollout.data_plane", "workers", "--rollout.loop", "async"),
            *("--rollout.batch_size", "2", "--rollout.group_size", str(GROUP_SIZE)),
            *("--rollout.max_response_tokens", str(MAX_NEW_TOKENS)),
            *("--rollout.partial_rollout", str(partial).lower(), "--engine.use_router", "false"),
        )
    )
    manager = RolloutManager(
        config,
        model_dir=tmp_path,
        tokenizer=load_tokenizer(TOKENIZER),
        source=Prompts(),
        log_dir=tmp_path,
    )
    manager.engines.servers = [engine]
    manager.start()  # one worker: engines started outside Ray placement
    manager.workers += start_rollout_workers(manager)
    manager.rollout_function = WorkerRollout(manager.workers)
    return manager


def run_async_rollout(tmp_path, partial: bool) -> SimpleNamespace:
    """Chunk 1 (draws 0 and 1; draw 1 held by the engine), a weight update to version 1
    while draw 1 is in flight, chunk 2 (draw 1 resumed, draw 2), then two takes."""
    engine = ScriptedEngine()
    manager = two_worker_manager(tmp_path, engine, partial)
    pool = manager.engines
    producer = ContinuousRollout(manager, batch_size=2, max_staleness=1, partial=partial)
    try:
        pool.call(producer.start())
        engine.wait_for(lambda: engine.answered(0, "0") == GROUP_SIZE)
        engine.wait_for(lambda: len(engine.state.waiting) == GROUP_SIZE)  # draw 1 in flight
        pool.call(pool.pause_generation())  # as AsyncFeed.before_sync
        client = pool.client(engine.url)
        pool.call(client.update_weights_from_disk(str(tmp_path), weight_version="1"))
        pool.confirm_version(1)
        pool.call(pool.continue_generation())  # as AsyncFeed.after_sync
        first = pool.call(producer.take(2, min_version=0))
        second = pool.call(producer.take(2, min_version=1))
        pool.call(producer.stop())
        holder = dict(manager.rollout_function.holder)
        # read while the workers that own the rows' objects live: stopping them loses those
        rows = [row for group in first[0] + second[0] for row in group]
        kept = {row.index: stored(row) for row in rows}
    finally:
        manager.stop()
    return SimpleNamespace(
        first=first, second=second, log=engine.state.log, holder=holder, stored=kept
    )


def stored(row) -> tuple[list[int], list[float]]:
    """A row's ids and engine log-probs, read from its worker's objects."""
    import ray

    (ids, id_bounds), (values, value_bounds) = ray.get([row.tokens_ref, row.log_probs_ref])
    tokens = ids[id_bounds[row.row] : id_bounds[row.row + 1]].tolist()
    log_probs = values[value_bounds[row.row] : value_bounds[row.row + 1]]
    return tokens, np.round(log_probs, 3).tolist()


@pytest.mark.parametrize("partial", [True, False], ids=["partial", "restart"])
def test_a_paused_group_is_held_by_its_worker_and_resumed(ray_cluster, tmp_path, partial):
    got = run_async_rollout(tmp_path, partial)
    (first, first_metrics), (second, second_metrics) = got.first, got.second
    draws = [g[0].group_index for g in first + second]
    assert draws == [0, 1, 2, 3]  # each draw once, in draw order; nothing lost
    rows = [row for group in first + second for row in group]
    assert [r.index for r in rows] == list(range(4 * GROUP_SIZE))  # no sample repeated
    assert all(r.status.value == "completed" for r in rows)
    assert first_metrics["async/chunks"] == 2 and first_metrics["async/groups_aborted"] == 1
    assert first_metrics["async/stale_groups_dropped"] == 0
    assert second_metrics["async/groups_aborted"] == 0
    assert got.holder == {}  # every held group was resumed

    held = first[1]
    if partial:  # 2 tokens of version 0 kept, 2 more of version 1 appended
        response = [TOKEN["0"]] * PARTIAL + [TOKEN["1"]] * (MAX_NEW_TOKENS - PARTIAL)
        log_probs = [-1.0] * PARTIAL + [-2.0] * (MAX_NEW_TOKENS - PARTIAL)
        versions = ["0", "1"]
    else:  # started again from the prompt on version 1
        response, log_probs, versions = [TOKEN["1"]] * MAX_NEW_TOKENS, [-2.0] * 4, ["1"]
    for row in held:
        assert row.weight_versions == versions
        assert row.response_length == MAX_NEW_TOKENS
        assert got.stored[row.index] == ([HELD_DRAW, *response], log_probs)
    for row in first[0]:  # answered before the update
        assert row.weight_versions == ["0"] and got.stored[row.index][0] == [0] + [TOKEN["0"]] * 4
    for row in (r for group in second for r in group):  # drawn after it
        assert row.weight_versions == ["1"] and got.stored[row.index][1] == [-2.0] * 4

    # the engine saw draw 1 once in flight on version 0, then once again after the update
    # (the partial responses, or the bare prompt), never a third time
    seen = [(ids, budget, version, finish) for d, ids, budget, version, finish in got.log]
    seen = [s for s, entry in zip(seen, got.log, strict=True) if entry[0] == HELD_DRAW]
    before = [([HELD_DRAW], MAX_NEW_TOKENS, "0", "abort")] * GROUP_SIZE
    if partial:
        resumed = [HELD_DRAW, *[TOKEN["0"]] * PARTIAL]
        after = [(resumed, MAX_NEW_TOKENS - PARTIAL, "1", "stop")] * GROUP_SIZE
    else:
        after = [([HELD_DRAW], MAX_NEW_TOKENS, "1", "stop")] * GROUP_SIZE
    assert seen == before + after
