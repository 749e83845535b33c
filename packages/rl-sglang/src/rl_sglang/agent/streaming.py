"""Relaying a streamed ``/generate`` to an OpenAI chat client as the engine samples it.

SGLang streams ``/generate`` as server-sent events whose ``output_ids`` and ``meta_info``
(``output_token_logprobs`` included) are cumulative by default, and deltas when the server
runs with ``--incremental-streaming-output``; :func:`merge_chunk` keeps the whole output so
far either way, so the turn the gateway records at the end is the one a plain
``/generate`` returns. :class:`IncrementalText` decodes the growing ids a few at a time
(decoding all of them at every token costs time quadratic in the reply's length, on the
event loop every session shares). :class:`ContentDeltas` turns that text into OpenAI
content deltas, holding back what may still become a tool call (the parser's
``streamable``) and an unfinished UTF-8 character, so that the deltas joined equal the
content of the non-streamed reply. :class:`ChunkWriter` writes the
``chat.completion.chunk`` events.
"""

import json
import time
import uuid

from aiohttp import web

REPLACEMENT = "\ufffd"  # what a decoder writes for the first bytes of an unfinished character


def merge_chunk(output: dict | None, chunk: dict) -> dict:
    """The ``/generate`` output so far, after ``chunk``. A chunk carrying fewer ids than its
    ``meta_info["completion_tokens"]`` is a delta (SGLang's incremental streaming): its ids
    and log-probs extend ``output``; any other replaces it."""
    ids, meta = list(chunk.get("output_ids") or []), dict(chunk.get("meta_info") or {})
    if output is None or meta.get("completion_tokens", len(ids)) == len(ids):
        return {**chunk, "output_ids": ids, "meta_info": meta}
    before = output["meta_info"].get("output_token_logprobs") or []
    logprobs = before + (meta.get("output_token_logprobs") or [])
    return {
        **chunk,
        "output_ids": output["output_ids"] + ids,
        "meta_info": {**meta, "output_token_logprobs": logprobs},
    }


class IncrementalText:
    """The text of a growing list of ids, ``decode`` called on the ids since the last
    settled point only. The previous step's ids are decoded with the new ones and their
    own text cut off, so a token whose text depends on the one before (SentencePiece's
    leading space) comes out as in a whole decode; ids whose text ends in an unfinished
    character wait for the next ones."""

    def __init__(self, decode):
        self.decode, self.text = decode, ""
        self.start = self.settled = 0  # ids[start:settled]: the step before, for context

    def update(self, ids: list[int]) -> str:
        """The text of ``ids`` (which extend the previous call's) up to the last settled
        point."""
        if len(ids) > self.settled:
            window = self.decode(ids[self.start :])
            before = self.decode(ids[self.start : self.settled])
            if window.startswith(before) and not window.endswith(REPLACEMENT):
                self.text += window[len(before) :]
                self.start, self.settled = self.settled, len(ids)
        return self.text


class ContentDeltas:
    """The content deltas of one streamed reply, from its text decoded so far."""

    def __init__(self, parser):
        self.parser, self.sent = parser, ""

    def delta(self, text: str) -> str:
        """What of ``text`` is now surely content and was not sent yet."""
        safe = self.parser.streamable(text).rstrip(REPLACEMENT)
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        new, self.sent = safe[len(self.sent) :], safe
        return new

    def rest(self, content: str) -> str | None:
        """What the final ``content`` adds to what was sent; None when it does not begin
        with it (a tokenizer whose decode of a prefix of ids is not a prefix of the
        decode of all of them)."""
        return content[len(self.sent) :] if content.startswith(self.sent) else None


class ChunkWriter:
    """The server-sent events of one streamed chat completion."""

    def __init__(self, request: web.Request, model: str):
        self.request = request
        self.head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )

    async def open(self) -> None:
        """Send the headers and the assistant's role, before the engine's first token."""
        await self.response.prepare(self.request)
        await self.send({"role": "assistant", "content": ""})

    async def send(self, delta: dict, finish: str | None = None, **extra) -> None:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        await self._event({**self.head, "choices": [{**choice, **extra}]})

    async def close(self, usage: dict | None = None) -> None:
        """The usage chunk (when the client asked for it) and ``[DONE]``."""
        if usage is not None:
            await self._event({**self.head, "choices": [], "usage": usage})
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()

    async def _event(self, chunk: dict) -> None:
        await self.response.write(f"data: {json.dumps(chunk)}\n\n".encode())
