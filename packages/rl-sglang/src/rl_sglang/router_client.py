"""A client of sglang-router that still gets what the router strips from /generate.

sglang-router 0.3.2 (the newest release on PyPI) parses each /generate body into its own
request type and forwards that type re-serialised: fields it does not know never reach
the engine. Of SGLang 0.5.15's fields it drops ``return_routed_experts`` and
``routed_experts_start_len`` (rollout routing replay) and ``sampling_params.custom_params``;
it keeps ``rid``, ``n``, ``sampling_seed``, ``lora_path``, the log-prob options. The
engine's answer comes back whole, ``meta_info["routed_experts"]`` included.

:class:`RouterClient` is an :class:`~rl_sglang.client.EngineClient` of the router that
sends a /generate asking for routed experts straight to one of the router's healthy
workers instead (the one with the fewest such requests from this client in flight, ties
in turn), and everything else through the router.

    client = RouterClient(router.url)
    out = await client.generate(input_ids=ids, return_routed_experts=True)  # on a worker
"""

import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp

from rl_sglang.client import EngineClient, EngineError

# /generate fields sglang-router 0.3.2 drops that a request of this project may set
ROUTER_DROPPED_FIELDS = ("return_routed_experts", "routed_experts_start_len")
WORKERS_TTL_S = 1.0  # how long the router's list of healthy workers is reused


def needs_worker(body: dict) -> bool:
    """True when ``body`` sets a field the router would drop (:data:`ROUTER_DROPPED_FIELDS`)."""
    return any(body.get(name) for name in ROUTER_DROPPED_FIELDS)


class RouterClient(EngineClient):
    """The router's client; a /generate that :func:`needs_worker` goes to a worker.

    ``worker_client(url)`` gives the client of a worker (default: one of this client's own,
    with its API key and timeout). The router's ``GET /workers`` is read at most every
    ``workers_ttl_s`` seconds, and again after a worker failed a request: a worker the
    router took out (a dead engine being restarted) gets no new request.
    """

    def __init__(
        self,
        url: str,
        *,
        worker_client: Callable[[str], EngineClient] | None = None,
        workers_ttl_s: float = WORKERS_TTL_S,
        **kwargs: Any,
    ):
        super().__init__(url, **kwargs)
        self._own_clients: dict[str, EngineClient] = {}
        self._worker_client = worker_client or self._own_client
        self.workers_ttl_s = workers_ttl_s
        self.in_flight: Counter[str] = Counter()  # worker url -> requests sent, not answered
        self._workers: list[str] = []
        self._workers_read_at = -math.inf
        self._turn = 0

    async def _post_generate(self, body: dict) -> Any:
        if not needs_worker(body):
            return await super()._post_generate(body)
        url = await self._pick_worker()
        self.in_flight[url] += 1
        try:
            return await self._worker_client(url).request("POST", "/generate", body)
        except (aiohttp.ClientError, EngineError):
            self._workers_read_at = -math.inf  # the next request reads the list again
            raise
        finally:
            self.in_flight[url] -= 1

    async def healthy_workers(self) -> list[str]:
        """The URLs of the router's healthy workers (re-read after ``workers_ttl_s``)."""
        if time.monotonic() - self._workers_read_at > self.workers_ttl_s:
            listing = await self.request("GET", "/workers")
            self._workers = [w["url"] for w in listing["workers"] if w.get("is_healthy")]
            self._workers_read_at = time.monotonic()
        return self._workers

    async def _pick_worker(self) -> str:
        urls = await self.healthy_workers()
        if not urls:  # 503: retried by the caller, as the router's own answer would be
            raise EngineError(self.url + "/workers", 503, "the router has no healthy worker")
        self._turn = (self._turn + 1) % len(urls)
        in_turn = urls[self._turn :] + urls[: self._turn]
        return min(in_turn, key=lambda url: self.in_flight[url])

    def _own_client(self, url: str) -> EngineClient:
        if url not in self._own_clients:
            self._own_clients[url] = EngineClient(
                url, timeout_s=self.timeout_s, api_key=self.api_key
            )
        return self._own_clients[url]

    async def close(self) -> None:
        await super().close()
        for client in self._own_clients.values():
            await client.close()
