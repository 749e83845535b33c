"""Stand-in engines: SGLang's HTTP API with modeled compute, several engines per process.

    hosts = start_sim_engines(config, sites, model=SimModel(...))   # one actor per node
    hosts[0].url                                                   # http://<node>:<port>

Each simulated node's engines are aiohttp apps on one event loop inside one Ray actor
(:class:`SimEngineHost`, no torch), scheduled into the node's first engine bundle. They
answer the subset of the API the launcher speaks (``/generate`` with ``n`` and batches,
``/abort_request``, ``/pause_generation``, ``/continue_generation``, ``/health``,
``/model_info``, ``/server_info``, memory release and resume, ``/freeze_gc``,
``/flush_cache``, the four weight updates, each bumping ``weight_version``). What they do is
modeled: a response of L tokens takes L / ``tokens_per_s`` seconds (every request decodes
at that rate: no batching limit), and a weight bucket of B bytes takes B /
``weight_gb_per_s`` seconds (nothing is sent: the bucket's shapes say its size).
:class:`SimEngine` is the driver's handle, shaped like
:class:`~rl_launcher.roles.engine_hosts.PlacedEngine` for the router and the pool.
"""

import asyncio
import math
import os
import random
import socket
import threading
import time
from dataclasses import dataclass

import ray
from aiohttp import web

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, kw_only=True)
class SimModel:
    """What the stand-ins model: decode rate per request, weight size and link rate,
    train step, log-prob pass and checkpoint time per rank, and the response lengths."""

    tokens_per_s: float = 2000.0  # decode rate of one request
    weight_bytes: int = 1 << 30  # what a sync moves to every engine
    weight_gb_per_s: float = 20.0  # into one engine (one bucket broadcast)
    gather_gb_per_s: float = 50.0  # a rank gathering the full weights before a sync
    train_s: float = 0.2  # one optimizer step on a rank
    log_probs_s: float = 0.05  # the old-policy forward on a rank
    checkpoint_s: float = 0.1  # a rank writing its shard
    # colocated turns, as rl-fsdp with SGLang took them on 4x H200 (2026-11-22, the
    # driver's wall time per transition: docs/results/2026-11-22-h200x4-host-batches)
    release_s: float = 0.04  # an engine releasing weights, KV cache and CUDA graphs
    resume_s: float = 0.02  # an engine resuming them
    offload_s: float = 0.16  # a rank moving its training state to host memory
    onload_s: float = 0.23  # and back
    vocab_size: int = 16
    seed: int = 0


class SimEngineState:
    """One stand-in engine: its version, pause flag and requests in flight."""

    def __init__(self, model: SimModel, index: int):
        self.model, self.index = model, index
        self.weight_version, self.paused = "0", False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.in_flight: dict[str, asyncio.Event] = {}  # rid -> abort signal
        self.random = random.Random(model.seed * 1000 + index)
        self.num_requests = 0

    def abort(self, rid: str | None) -> int:
        hits = [e for r, e in self.in_flight.items() if rid is None or r == rid]
        for event in hits:
            event.set()
        return len(hits)

    async def one_output(self, prompt_ids: list[int], params: dict, logprob: bool) -> dict:
        """One modeled response: a random length up to ``max_new_tokens``, decoded at the
        model's rate unless aborted (then the tokens made so far, finish ``abort``)."""
        await self.resumed.wait()  # a paused engine holds new requests, as SGLang does
        limit = int(params.get("max_new_tokens", 128))
        length = self.random.randint(max(1, limit // 4), limit) if limit else 0
        rid, stop, started = (
            f"sim-{self.index}-{self.num_requests}",
            asyncio.Event(),
            time.monotonic(),
        )
        self.num_requests += 1
        self.in_flight[rid] = stop
        try:
            await asyncio.wait_for(stop.wait(), timeout=length / self.model.tokens_per_s)
            done = min(length, int((time.monotonic() - started) * self.model.tokens_per_s))
            finish = {"type": "abort", "message": "aborted"}
        except TimeoutError:
            done = length
            finish = {"type": "length"} if length == limit else {"type": "stop", "matched": 0}
        finally:
            del self.in_flight[rid]
        ids = [self.random.randrange(self.model.vocab_size) for _ in range(done)]
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": done,
            "cached_tokens": 0,
            "e2e_latency": time.monotonic() - started,
            "weight_version": self.weight_version,
        }
        if logprob:
            meta["output_token_logprobs"] = [[-1.0, t, None] for t in ids]
        return {"text": "", "output_ids": ids, "meta_info": meta}

    async def update(self, body: dict, num_bytes: int) -> dict:
        await asyncio.sleep(num_bytes / (self.model.weight_gb_per_s * 1e9))
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return {"success": True, "message": "updated", "weight_version": self.weight_version}


def bucket_bytes(body: dict) -> int:
    """The bytes a weight update's bucket would carry (its shapes and dtypes)."""
    shapes, dtypes = body.get("shapes") or [], body.get("dtypes") or []
    return sum(math.prod(s) * DTYPE_BYTES.get(d, 2) for s, d in zip(shapes, dtypes, strict=True))


def make_app(state: SimEngineState, api_key: str = "") -> web.Application:
    """The engine's routes over ``state`` (``api_key``: Bearer on all but /health*)."""
    routes = web.RouteTableDef()

    @web.middleware
    async def check_key(request, handler):
        given = request.headers.get("Authorization", "")
        if api_key and not request.path.startswith("/health") and given != f"Bearer {api_key}":
            return web.json_response({"error": "api key"}, status=401)
        return await handler(request)

    async def body_of(request) -> dict:
        return await request.json() if request.can_read_body else {}

    @routes.get("/health")
    @routes.get("/health_generate")
    async def health(request):
        return web.Response(text="")

    @routes.get("/model_info")
    @routes.get("/get_model_info")
    @routes.get("/server_info")
    @routes.get("/get_server_info")
    async def info(request):
        return web.json_response(
            {
                "model_path": "simulated",
                "is_generation": True,
                "weight_version": state.weight_version,
            }
        )

    @routes.post("/generate")
    async def generate(request):
        body = await body_of(request)
        prompts = body.get("input_ids") or [[0]]
        is_batch = isinstance(prompts[0], list)
        prompts = prompts if is_batch else [prompts]
        params = body.get("sampling_params") or {}
        logprob = bool(body.get("return_logprob"))
        jobs = [
            state.one_output(p, params, logprob) for p in prompts for _ in range(params.get("n", 1))
        ]
        outputs = await asyncio.gather(*jobs)
        if is_batch or len(outputs) > 1:
            return web.json_response(outputs)
        return web.json_response(outputs[0])

    @routes.post("/abort_request")
    async def abort(request):
        body = await body_of(request)
        state.abort(None if body.get("abort_all") else body.get("rid"))
        return web.json_response({"success": True})

    @routes.post("/pause_generation")
    async def pause(request):
        state.paused = True
        state.resumed.clear()
        num = state.abort(None)
        return web.json_response({"success": True, "num_paused_requests": num})

    @routes.post("/continue_generation")
    async def resume(request):
        state.paused = False
        state.resumed.set()
        return web.json_response({"success": True})

    @routes.route("*", "/flush_cache")
    @routes.route("*", "/freeze_gc")
    @routes.post("/init_weights_update_group")
    async def ok(request):
        return web.json_response({"success": True, "message": "simulated"})

    @routes.post("/release_memory_occupation")
    async def release(request):
        await asyncio.sleep(state.model.release_s)
        return web.json_response({"success": True, "message": "released (simulated)"})

    @routes.post("/resume_memory_occupation")
    async def resume_memory(request):
        await asyncio.sleep(state.model.resume_s)
        return web.json_response({"success": True, "message": "resumed (simulated)"})

    @routes.post("/update_weights_from_distributed")
    @routes.post("/update_weights_from_tensor")
    @routes.post("/update_weights_from_disk")
    async def update(request):
        body = await body_of(request)
        return web.json_response(await state.update(body, bucket_bytes(body)))

    app = web.Application(middlewares=[check_key], client_max_size=1 << 30)
    app.add_routes(routes)
    return app


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class SimEngineHost:
    """A Ray actor serving ``num_engines`` stand-in engines on its node, one port each,
    from one event loop on a background thread."""

    def __init__(self, model: SimModel, first_index: int, num_engines: int, host, api_key):
        self.host = host or ray.util.get_node_ip_address()
        self.api_key = api_key or ""
        self.states = [SimEngineState(model, first_index + i) for i in range(num_engines)]
        self.ports = [free_port(self.host) for _ in self.states]
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result()

    async def _serve(self) -> None:
        for state, port in zip(self.states, self.ports, strict=True):
            runner = web.AppRunner(make_app(state, self.api_key), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, self.host, port).start()

    def where(self) -> list[dict]:
        node = ray.get_runtime_context().get_node_id()
        return [
            {"url": f"http://{self.host}:{p}", "node_id": node, "pid": os.getpid()}
            for p in self.ports
        ]

    def rss_bytes(self) -> int:
        return rss_bytes()


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc)."""
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class SimEngine:
    """The driver's handle on one stand-in engine (as ``PlacedEngine``: ``url``,
    ``api_key``, ``alive``, ``start``, ``wait_ready``, ``kill``, ``stop``, ``process``)."""

    name = "engine"

    def __init__(self, host_actor, where: dict, api_key: str | None):
        self.actor, self.api_key = host_actor, api_key
        self.url, self.node_id = where["url"], where["node_id"]
        self.process = _Process(where["pid"])

    def start(self, wait: bool = True) -> "SimEngine":
        return self

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Serving since its host's constructor returned."""

    def alive(self) -> bool:
        return True

    def healthy(self) -> bool:
        return True

    def kill(self) -> None:
        """Stand-ins are not killed one by one."""

    def stop(self) -> None:
        ray.kill(self.actor)  # every engine of the node: later stops find it gone

    def log_tail(self, num_lines: int = 30) -> str:
        return ""


@dataclass
class _Process:
    pid: int

    def poll(self) -> int | None:
        return None


def start_sim_engines(config, sites, *, model: SimModel) -> list[SimEngine]:
    """One :class:`SimEngineHost` per node holding engines (in its first engine's first
    bundle, no resources of its own), serving every engine placed on that node."""
    by_node: dict[str, list[int]] = {}
    for engine, bundles in enumerate(sites.plan.engine_bundles):
        by_node.setdefault(sites.placement.node_ids[bundles[0]], []).append(engine)
    actor = ray.remote(SimEngineHost)
    hosts = []
    for engines in by_node.values():
        first_bundle = sites.plan.engine_bundles[engines[0]][0]
        hosts.append(
            actor.options(
                num_cpus=0, scheduling_strategy=sites.placement.strategy(first_bundle)
            ).remote(model, engines[0], len(engines), sites.host, sites.api_key)
        )
    placed = ray.get([h.where.remote() for h in hosts])
    return [
        SimEngine(host, where, sites.api_key)
        for host, wheres in zip(hosts, placed, strict=True)
        for where in wheres
    ]
