"""Tool-call parsers: the model's reply text -> OpenAI ``tool_calls``, by format name.

- ``hermes`` (Qwen2/2.5/3, Hermes, SmolLM and other ChatML templates): ``<tool_call>{"name":
  ..., "arguments": {...}}</tool_call>`` blocks anywhere in the reply.
- ``llama3_json`` (Llama 3.1 / 3.2): the whole reply is ``{"name": ..., "parameters":
  {...}}`` (several separated by ``;``), optionally after ``<|python_tag|>``.

Each parser has ``parse(text) -> (content, tool_calls, invalid)`` and
``streamable(text)``: the part of a reply still being generated that is content whatever
tokens follow, so a stream can send it before the reply ends and never send a tool call's
text as content. A malformed call is never an error: the reply stays plain content and
``invalid`` counts it. :func:`tool_parser` picks a parser by name, else by the chat
template (:func:`detect_tool_parser`).
"""

import json
import re
import uuid

PYTHON_TAG = "<|python_tag|>"


def openai_call(name: str, arguments) -> dict:
    """One OpenAI ``tool_calls`` entry (arguments as a JSON string, as OpenAI sends them)."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _call(obj) -> dict | None:
    """``obj`` as an OpenAI call if it has a string ``name`` and object arguments
    (``arguments``, or Llama's ``parameters``), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return openai_call(obj["name"], arguments)


class HermesParser:
    """``<tool_call>{...}</tool_call>`` blocks; content is the text outside them (trailing
    whitespace dropped) when at least one block is a valid call, else the whole text."""

    start = "<tool_call>"
    block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str) -> tuple[str, list[dict], int]:
        calls, invalid = [], 0
        for body in self.block.findall(text):
            try:
                call = _call(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                invalid += 1
            else:
                calls.append(call)
        content = self.block.sub("", text).rstrip() if calls else text
        return content, calls, invalid

    def streamable(self, text: str) -> str:
        """The text before the first (possibly still partial) ``<tool_call>``, without
        trailing whitespace (dropped if a call follows)."""
        cut = text.find(self.start)
        if cut < 0:
            cut = len(text) - _partial_suffix(text, self.start)
        return text[:cut].rstrip()


class Llama3JsonParser:
    """A reply that is (after optional whitespace and ``<|python_tag|>``) one or more JSON
    calls separated by ``;``: all of them valid, or the reply is content and counts one
    invalid. A reply that starts otherwise is content, not an attempted call."""

    def parse(self, text: str) -> tuple[str, list[dict], int]:
        head = text.strip()
        if not (head.startswith(PYTHON_TAG) or head.startswith("{")):
            return text, [], 0
        calls = _json_calls(head.removeprefix(PYTHON_TAG).strip())
        return ("", calls, 0) if calls else (text, [], 1)

    def streamable(self, text: str) -> str:
        """All of it once it cannot be a call any more; nothing before."""
        head = text.lstrip()
        could_be_call = (
            not head
            or head.startswith("{")
            or head.startswith(PYTHON_TAG)
            or PYTHON_TAG.startswith(head)
        )
        return "" if could_be_call else text


def _json_calls(body: str) -> list[dict]:
    """The calls of ``{...}; {...}``, or [] if any part is not a valid call."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return []
        call = _call(obj)
        if call is None:
            return []
        calls.append(call)
        rest = body[at:].lstrip()
        if rest and not rest.startswith(";"):
            return []
        at = len(body) - len(rest.removeprefix(";").lstrip())
    return calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (0 if none)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


TOOL_PARSERS = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}


def detect_tool_parser(tokenizer) -> str:
    """The format the tokenizer's chat template writes tool calls in: ``llama3_json`` for
    Llama 3 templates (``<|python_tag|>``, or headers with ``parameters``), else
    ``hermes``."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if "<tool_call>" in template:
        return "hermes"
    llama = "<|start_header_id|>" in template and "parameters" in template
    return "llama3_json" if PYTHON_TAG in template or llama else "hermes"


def tool_parser(name: str | None, tokenizer=None):
    """The parser called ``name``, or the one the tokenizer's chat template implies."""
    name = name or detect_tool_parser(tokenizer)
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; use one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
