"""A real HTTP endpoint for the launcher's tests: aiohttp on 127.0.0.1, in a thread of its
own, answering POSTs to one path and recording what each request showed.

``answer(body, request)`` gets the request's JSON body (and the request, for headers) and
returns ``(record, reply)``: the record is appended to ``server.seen``, the reply is sent as
JSON. To refuse a request it raises one of aiohttp's HTTP errors (``web.HTTPUnauthorized``).
The stand-in SGLang server (``standin_sglang/``) is a separate program on purpose: it runs
as ``python -m sglang.launch_server`` in other processes, where this module is not on the
path."""

import asyncio
import threading
from collections.abc import Awaitable, Callable

from aiohttp import web

Answer = Callable[[dict, web.Request], Awaitable[tuple[object, object]]]


class RecordingServer:
    """``POST {path}`` -> ``answer``'s reply; ``seen``: its records, in the order answered.
    A context manager: leaving it stops the server."""

    def __init__(self, path: str, answer: Answer, max_body_bytes: int = 1 << 26):
        self.seen: list = []
        self._answer = answer
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(self._start(path, max_body_bytes), self._loop)
        self._runner = started.result(timeout=10)
        self.port = self._runner.addresses[0][1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self, path: str, max_body_bytes: int) -> web.AppRunner:
        app = web.Application(client_max_size=max_body_bytes)
        app.router.add_post(path, self._handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()  # port 0: a free one, no race
        return runner

    async def _handle(self, request: web.Request) -> web.Response:
        record, reply = await self._answer(await request.json(), request)
        self.seen.append(record)
        return web.json_response(reply)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> "RecordingServer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
