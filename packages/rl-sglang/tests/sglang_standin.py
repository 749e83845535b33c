"""A stand-in SGLang server for tests of what passes through sglang-router: aiohttp on
127.0.0.1 in a thread of its own, answering SGLang's HTTP API (``/health``, the info
endpoints, ``/generate``) without a model, and recording every /generate body it gets.

/generate answers ``max_new_tokens`` tokens (``n`` outputs for ``sampling_params.n`` > 1),
each output id the previous id + 1, with log-prob -0.5. A request with
``return_routed_experts`` gets SGLang 0.5.15's ``meta_info["routed_experts"]``: base64 of
the int32 bytes of ``[seqlen - 1 - routed_experts_start_len, L, K]``, row t the experts
token t went to in each layer (here :func:`standin_routes`, a function of the token id);
with ``routes_always`` set, every answer has them.
"""

import asyncio
import base64
import threading

import numpy as np
from aiohttp import web


def standin_routes(tokens: list[int], num_layers: int, top_k: int, num_experts: int):
    """``[len(tokens), L, K]`` int32: token id t goes to experts (t + layer + k) % E."""
    ids = np.asarray(tokens, dtype=np.int64)[:, None, None]
    layer = np.arange(num_layers)[None, :, None]
    k = np.arange(top_k)[None, None, :]
    return ((ids + layer + k) % num_experts).astype(np.int32)


class SGLangStandIn:
    """A context manager; ``seen``: the /generate bodies in the order they came."""

    def __init__(self, *, num_layers: int = 3, top_k: int = 2, num_experts: int = 8):
        self.shape = (num_layers, top_k, num_experts)
        self.seen: list[dict] = []
        self.routes_always = False  # True: routes in every answer, asked for or not
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self._runner = started.result(timeout=10)
        self.port = self._runner.addresses[0][1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        for path in ("/health", "/health_generate"):
            app.router.add_get(path, self._ok)
        for path in ("/get_model_info", "/model_info", "/get_server_info", "/server_info"):
            app.router.add_get(path, self._info)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    async def _ok(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": "stand-in", "is_generation": True, "weight_version": "0"}
        )

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(body)
        params = body.get("sampling_params") or {}
        outputs = [self.output(body, params, row) for row in range(params.get("n", 1))]
        return web.json_response(outputs if params.get("n", 1) > 1 else outputs[0])

    def output(self, body: dict, params: dict, row: int) -> dict:
        prompt = list(body["input_ids"])
        new = [(prompt[-1] + row + 1 + i) % 300 for i in range(params.get("max_new_tokens", 4))]
        meta = {
            "id": f"standin-{len(self.seen)}-{row}",
            "finish_reason": {"type": "length", "length": len(new)},
            "prompt_tokens": len(prompt),
            "completion_tokens": len(new),
            "output_token_logprobs": [[-0.5, token, None] for token in new],
            "weight_version": "0",
        }
        if body.get("return_routed_experts") or self.routes_always:
            ran = (prompt + new)[body.get("routed_experts_start_len", 0) : -1]  # not the last
            routes = standin_routes(ran, *self.shape)
            meta["routed_experts"] = base64.b64encode(routes.tobytes()).decode("ascii")
        return {"text": "", "output_ids": new, "meta_info": meta}

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> "SGLangStandIn":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
