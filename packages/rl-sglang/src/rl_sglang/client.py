"""Async HTTP client for the SGLang native API subset (a server, the embedded engine or
sglang-router in front of either)."""

import asyncio
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from rl_sglang.process import API_KEY_ENV
from rl_sglang.protocol import decode_json, parse_token_logprobs


class EngineError(RuntimeError):
    """An engine answered with an error status or ``success: false``."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url} -> HTTP {status}: {message}")
        self.status = status


class EngineClient:
    """One base URL, one aiohttp session. Use as ``async with EngineClient(url) as c:``.

    ``retries`` re-sends a /generate whose connection failed or that got a 5xx (an engine
    killed mid-request and restarted, or the router failing over). ``api_key`` is sent as
    ``Authorization: Bearer`` (servers exposed beyond loopback require it); by default it
    is taken from the ``RL_SGLANG_API_KEY`` environment variable, like the servers' key.
    ``lora_path``: the LoRA adapter (its name on the engines) that every /generate sent
    without one of its own asks for; None: the base model. A trainer syncing adapters
    sets it to each new version's name.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 600.0,
        retries: int = 0,
        backoff_s=0.5,
        api_key: str | None = None,
        lora_path: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.lora_path = lora_path
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self.headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.timeout_s = timeout_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.retries, self.backoff_s = retries, backoff_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0)  # rollouts open many concurrent requests
            self._session = aiohttp.ClientSession(
                timeout=self.timeout, connector=connector, headers=self.headers
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(self, method: str, path: str, body: dict | None = None) -> Any:
        """JSON (or text) of one call; raises :class:`EngineError` on an error status."""
        async with self.session.request(method, self.url + path, json=body) as response:
            raw = await response.read()
            if response.status >= 400:
                raise EngineError(self.url + path, response.status, _text(raw))
            try:
                data = decode_json(raw) if raw else None
            except (json.JSONDecodeError, UnicodeDecodeError):  # text (/flush_cache, /freeze_gc)
                return _text(raw)
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(self.url + path, response.status, data.get("message", _text(raw)))
        return data

    # ---- generation ---------------------------------------------------------------------
    async def generate(self, **body: Any) -> Any:
        """POST /generate with GenerateReqInput fields (``input_ids`` or ``text``,
        ``sampling_params``, ``return_logprob``, ``rid``, ``lora_path``); retried per
        ``retries``."""
        body = self._with_adapter(body)
        for attempt in range(self.retries + 1):
            try:
                return await self._post_generate(body)
            except (aiohttp.ClientConnectionError, EngineError) as error:
                retryable = not isinstance(error, EngineError) or error.status >= 500
                if not retryable or attempt == self.retries:
                    raise
                await asyncio.sleep(self.backoff_s * (2**attempt))
        raise AssertionError("unreachable")

    async def _post_generate(self, body: dict) -> Any:
        """One /generate attempt (rl_sglang.router_client sends some past the router)."""
        return await self.request("POST", "/generate", body)

    def _with_adapter(self, body: dict) -> dict:
        if self.lora_path is None or "lora_path" in body:
            return body
        return body | {"lora_path": self.lora_path}

    async def prompt_logprobs(self, input_ids: list[int]) -> list[float]:
        """Teacher-forced log-probs ``[len(input_ids) - 1]``: entry i is the log-prob of
        ``input_ids[i + 1]`` given the ids before it (temperature 1). One /generate with
        ``max_new_tokens: 0``, ``return_logprob`` and ``logprob_start_len: 0``, which SGLang
        and the embedded engine answer with ``input_token_logprobs`` (the first, None,
        dropped). A distillation teacher scores the student's samples with it."""
        return (await self.prompt_logprobs_batch([input_ids]))[0]

    async def prompt_logprobs_batch(self, batch: list[list[int]]) -> list[list[float]]:
        """:meth:`prompt_logprobs` of every sequence of ``batch`` in one request (the
        embedded engine scores them in shared forwards)."""
        outs = await self.generate(
            input_ids=[list(ids) for ids in batch],
            sampling_params={"max_new_tokens": 0, "temperature": 1.0},
            return_logprob=True,
            logprob_start_len=0,
        )
        scores = []
        for ids, out in zip(batch, outs, strict=True):
            entries = out["meta_info"]["input_token_logprobs"]
            if len(entries) != len(ids):
                raise EngineError(
                    self.url,
                    200,
                    f"{len(entries)} input_token_logprobs for "
                    f"{len(ids)} ids; the engine ignored logprob_start_len",
                )
            scores.append(parse_token_logprobs(entries[1:])[0])
        return scores

    async def generate_stream(self, **body: Any) -> AsyncIterator[dict]:
        """Yield the chunks of a streamed /generate until ``[DONE]``."""
        body = self._with_adapter(body) | {"stream": True}
        async with self.session.post(self.url + "/generate", json=body) as resp:
            if resp.status >= 400:
                raise EngineError(self.url, resp.status, await resp.text())
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    yield json.loads(line.removeprefix("data:"))

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request, or all of them when ``rid`` is None (engines only; the router
        does not forward it)."""
        body = {"rid": rid} if rid is not None else {"rid": "", "abort_all": True}
        await self.request("POST", "/abort_request", body)

    # ---- state --------------------------------------------------------------------------
    async def health(self) -> bool:
        try:
            await self.request("GET", "/health")
            return True
        except (TimeoutError, aiohttp.ClientError, EngineError):
            return False

    async def health_generate(self) -> None:
        await self.request("GET", "/health_generate")

    async def model_info(self) -> dict:
        return await self.request("GET", "/model_info")

    async def server_info(self) -> dict:
        return await self.request("GET", "/get_server_info")

    async def weight_version(self) -> str:
        # /model_info carries it (SGLang 0.5.15 answers 404 on the old /get_weight_version)
        return (await self.model_info())["weight_version"]

    async def flush_cache(self) -> None:
        await self.request("POST", "/flush_cache")

    async def freeze_gc(self) -> str:
        """Move every object the server's processes hold now into Python's permanent
        generation (``gc.freeze``), so later full collections skip them; the server's
        answer (text)."""
        return await self.request("POST", "/freeze_gc")

    async def pause(self, mode: str = "abort") -> dict:
        return await self.request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> dict:
        return await self.request("POST", "/continue_generation", {})

    async def release_memory(self, tags: list[str] | None = None) -> dict:
        """Free GPU memory; ``tags`` picks parts (SGLang: "weights", "kv_cache",
        "cuda_graph"); None frees all."""
        return await self.request("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None = None) -> dict:
        return await self.request("POST", "/resume_memory_occupation", {"tags": tags})

    # ---- weight updates (see rl_sglang.transports for the trainer side) ------------------
    async def update_weights_from_disk(self, model_path: str, **fields: Any) -> dict:
        body = {"model_path": model_path, **fields}
        return await self.request("POST", "/update_weights_from_disk", body)

    async def update_weights_from_tensor(self, serialized: list[str], **fields: Any) -> dict:
        body = {"serialized_named_tensors": serialized, **fields}
        return await self.request("POST", "/update_weights_from_tensor", body)

    async def init_weights_update_group(self, **fields: Any) -> dict:
        """Fields: master_address, master_port, rank_offset, world_size, group_name, backend."""
        return await self.request("POST", "/init_weights_update_group", fields)

    async def update_weights_from_distributed(self, **fields: Any) -> dict:
        """Fields: names, dtypes, shapes, group_name, weight_version, flush_cache."""
        return await self.request("POST", "/update_weights_from_distributed", fields)

    # ---- LoRA adapters (engines started with --enable-lora) ------------------------------
    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False):
        """Serve the PEFT directory ``lora_path`` as ``lora_name``; SGLang's answer
        (``loaded_adapters``: name -> path)."""
        body = {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}
        return await self.request("POST", "/load_lora_adapter", body)

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        return await self.request("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    async def update_weight_version(self, new_version: str, abort_all_requests=False) -> dict:
        """Set the version the engine reports (an adapter load does not change it)."""
        body = {"new_version": str(new_version), "abort_all_requests": abort_all_requests}
        return await self.request("POST", "/update_weight_version", body)


def _text(raw: bytes) -> str:
    """An answer's body as text (the engines answer in UTF-8)."""
    return raw.decode("utf-8", errors="replace")
