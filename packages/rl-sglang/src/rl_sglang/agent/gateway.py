"""An OpenAI-compatible chat endpoint in front of the engines that records every session's
token-exact trajectory (:mod:`~rl_sglang.agent.sessions`).

    gateway = Gateway(EngineClient(router_url), tokenizer)
    url = await gateway.start()              # http://127.0.0.1:<port>/v1
    gateway.open("episode-1", {"temperature": 1.0, "max_new_tokens": 64})
    ... an agent calls openai.AsyncOpenAI(base_url=url).chat.completions.create(
            ..., extra_headers={"X-Session-Id": "episode-1"})
    samples = gateway.close("episode-1")    # one Sample per leaf of the trajectory tree

``POST /v1/chat/completions``: ``messages``, ``tools`` (OpenAI format, rendered through the
tokenizer's chat template), ``stream`` (server-sent events relayed token by token from the
engine's streamed ``/generate``, :mod:`~rl_sglang.agent.streaming`; the recorded turn is
the same as without streaming; ``stream_options.include_usage``), ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``. The session is the
``X-Session-Id`` header, else the ``user`` field. A session opened with sampling params
(the rollout's) generates with them, whatever the client asks (a client's smaller
``max_tokens`` still applies); an unopened one is opened by its first request with the
client's. Tool calls are read in the format ``tool_parser`` names (``hermes``:
``<tool_call>{...}</tool_call>``; ``llama3_json``: Llama 3.1/3.2's bare JSON; see
:mod:`~rl_sglang.agent.tools`), by default the one the chat template writes. Like the
engines, the gateway listens on loopback unless given an API key (then every request but
``/health`` needs ``Authorization: Bearer <key>``).
"""

import contextlib
import hmac
import time
import uuid

from aiohttp import web

from rl_sglang.agent import tools
from rl_sglang.agent.sessions import Session, Turn
from rl_sglang.agent.streaming import ChunkWriter, ContentDeltas, IncrementalText, merge_chunk
from rl_sglang.client import EngineError
from rl_sglang.process import check_exposure

SESSION_HEADER = "X-Session-Id"
GATEWAY_KEY = web.AppKey("gateway", object)


def parse_tool_calls(text: str) -> tuple[str, list[dict], int]:
    """``(content, tool_calls, invalid)`` of a reply in the Hermes / Qwen format."""
    return tools.TOOL_PARSERS["hermes"].parse(text)


class Gateway:
    """The HTTP server and its sessions (see the module docstring). ``tool_parser`` names
    the tool-call format (:data:`~rl_sglang.agent.tools.TOOL_PARSERS`; None: the one the
    tokenizer's chat template writes)."""

    def __init__(
        self,
        client,
        tokenizer,
        *,
        api_key: str | None = None,
        model: str = "policy",
        tool_parser: str | None = None,
    ):
        self.client, self.tokenizer, self.api_key, self.model = client, tokenizer, api_key, model
        self.parser = tools.tool_parser(tool_parser, tokenizer)
        self.sessions: dict[str, Session] = {}
        self.params: dict[str, dict] = {}
        self.counts = {
            "requests": 0,
            "tool_calls": 0,
            "invalid_tool_calls": 0,
            "stream_text_mismatches": 0,
        }
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: a free port); returns the base URL (``.../v1``)."""
        check_exposure(host, self.api_key, "the agent gateway")
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{bound}/v1"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app[GATEWAY_KEY] = self
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", _health)
        return app

    def open(self, session_id: str, sampling_params: dict | None = None) -> None:
        """Start recording ``session_id``, generating with ``sampling_params``."""
        self.sessions[session_id] = Session(self.tokenizer)
        if sampling_params is not None:
            self.params[session_id] = dict(sampling_params)

    def close(self, session_id: str, template=None) -> list:
        """The session's samples (one per leaf), forgetting it."""
        session = self.sessions.pop(session_id, None)
        self.params.pop(session_id, None)
        return [] if session is None else session.samples(template)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key and request.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return _error("missing or wrong 'Authorization: Bearer <api key>'", 401)
        return await handler(request)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": self.model, "object": "model", "created": 0, "owned_by": "rl-sglang"}
                ],
            }
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            session_id = request.headers.get(SESSION_HEADER) or body.get("user")
            if not session_id:
                raise ValueError(f"no session: send the {SESSION_HEADER} header or 'user'")
            if session_id not in self.sessions:
                self.open(session_id)
            session = self.sessions[session_id]
            turn = session.prompt(list(body.get("messages") or []), body.get("tools"))
            params = self._sampling_params(session_id, body)
        except (ValueError, KeyError, TypeError) as error:
            return _error(f"{type(error).__name__}: {error}", 400)
        generate = {"input_ids": turn.input_ids, "return_logprob": True, "sampling_params": params}
        if body.get("stream"):
            return await self._chat_stream(request, body, session, turn, generate)
        output = await self.client.generate(**generate)
        message, finish = self._finish(session, turn, output)
        return web.json_response(
            _completion(self.model, message, finish, len(turn.input_ids), output)
        )

    async def _chat_stream(
        self, request: web.Request, body: dict, session: Session, turn: Turn, generate: dict
    ) -> web.StreamResponse:
        """Relay the engine's tokens as content deltas while they come, then the tool
        calls, the finish reason (with ``token_ids`` and ``weight_version``) and, when
        asked for, the usage; record the turn exactly as :meth:`_chat` does."""
        writer, deltas, output = ChunkWriter(request, self.model), ContentDeltas(self.parser), None
        text = IncrementalText(self._decode)
        await writer.open()
        # closed at once if the client goes away mid-reply (its turn is then not recorded)
        async with contextlib.aclosing(self.client.generate_stream(**generate)) as chunks:
            async for chunk in chunks:
                output = merge_chunk(output, chunk)
                piece = deltas.delta(text.update(output["output_ids"]))
                if piece:
                    await writer.send({"content": piece})
        if output is None:
            raise EngineError(self.client.url, 502, "the streamed /generate sent no output")
        message, finish = self._finish(session, turn, output)
        rest = deltas.rest(message["content"] or "")
        self.counts["stream_text_mismatches"] += rest is None
        if rest:
            await writer.send({"content": rest})
        for index, call in enumerate(message.get("tool_calls", [])):
            await writer.send({"tool_calls": [{"index": index, **call}]})
        choice = _completion(self.model, message, finish, len(turn.input_ids), output)
        await writer.send(
            {},
            finish,
            token_ids=choice["choices"][0]["token_ids"],
            weight_version=choice["choices"][0]["weight_version"],
        )
        include_usage = (body.get("stream_options") or {}).get("include_usage")
        await writer.close(choice["usage"] if include_usage else None)
        return writer.response

    def _finish(self, session: Session, turn: Turn, output: dict) -> tuple[dict, str]:
        """The reply's assistant message and finish reason, the turn recorded."""
        message, finish = self._reply(output)
        session.record(turn, output, message)
        self.counts["requests"] += 1
        return message, finish

    def _sampling_params(self, session_id: str, body: dict) -> dict:
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        params = self.params.get(session_id)
        if params is None:
            params = {k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None}
            params["max_new_tokens"] = int(asked or 256)
        elif asked:
            params = {
                **params,
                "max_new_tokens": min(int(asked), params.get("max_new_tokens", asked)),
            }
        stop = body.get("stop")
        if stop:
            params = {**params, "stop": [stop] if isinstance(stop, str) else list(stop)}
        return params

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _reply(self, output: dict) -> tuple[dict, str]:
        content, calls, invalid = self.parser.parse(self._decode(output["output_ids"]))
        self.counts["tool_calls"] += len(calls)
        self.counts["invalid_tool_calls"] += invalid
        message = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = calls
        reason = output["meta_info"]["finish_reason"]["type"]
        finish = "tool_calls" if calls else ("length" if reason == "length" else "stop")
        return message, finish


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="")


def _error(message: str, status: int) -> web.Response:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    return web.json_response({"error": {"message": message, "type": kind}}, status=status)


def _completion(model: str, message: dict, finish: str, prompt_tokens: int, output) -> dict:
    completion_tokens = len(output["output_ids"])
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "logprobs": None,
                "token_ids": list(output["output_ids"]),
                "weight_version": str(output["meta_info"].get("weight_version", "")),
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
