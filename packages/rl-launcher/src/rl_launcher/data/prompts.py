"""Turn a dataset row into a prompt :class:`~rl_core.types.Sample` (checked and formatted).

A prompt is text or a list of chat messages (``{"role": ..., "content": ...}``). With a
tokenizer (any object with ``apply_chat_template`` and ``encode``), the prompt goes through
the chat template (with the row's tools, when given) and is tokenized; without one, the
prompt is kept as it is and has no token ids yet. The row's other columns go into the
sample's ``metadata`` (:func:`other_fields`).
"""

from typing import Any

from rl_core.types import Sample
from rl_launcher.config import DatasetConfig


class MalformedRow(ValueError):
    """A row that cannot become a prompt; the message says why."""


def sample_from_row(
    row: Any, spec: DatasetConfig, *, tokenizer: Any = None, apply_chat_template: bool = True
) -> Sample:
    """The prompt Sample of one parsed row; raises :class:`MalformedRow`."""
    if not isinstance(row, dict):
        raise MalformedRow(f"expected a JSON object, got {type(row).__name__}")
    prompt = _field(row, spec.prompt_key, required=True)
    _check_prompt(prompt, spec.prompt_key)
    metadata = _field(row, spec.metadata_key) or {}
    if not isinstance(metadata, dict):
        raise MalformedRow(
            f"{spec.metadata_key!r} must be a mapping, got {type(metadata).__name__}"
        )
    tools = _field(row, spec.tools_key)
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise MalformedRow(f"{spec.tools_key!r} must be a list of tool schemas (mappings)")
    metadata = {**other_fields(row, spec), **metadata}
    if tools:
        metadata["tools"] = tools
    if isinstance(prompt, list):
        metadata["messages"] = prompt
    text, token_ids = format_prompt(
        prompt, tools=tools, tokenizer=tokenizer, apply_chat_template=apply_chat_template
    )
    return Sample(
        prompt=text, tokens=token_ids or [], label=_field(row, spec.label_key), metadata=metadata
    )


def other_fields(row: dict, spec: DatasetConfig) -> dict[str, Any]:
    """The row's columns other than its prompt, label, metadata and tools: a reward taking
    the whole Sample (or a custom rollout) reads them from ``sample.metadata``; the
    metadata column's own keys win a clash."""
    used = {spec.prompt_key, spec.label_key, spec.metadata_key, spec.tools_key}
    return {key: value for key, value in row.items() if key not in used}


def _field(row: dict, key: str | None, *, required: bool = False) -> Any:
    if key is None:
        return None
    if required and row.get(key) is None:
        raise MalformedRow(f"missing prompt key {key!r} (row keys: {', '.join(map(str, row))})")
    return row.get(key)


def _check_prompt(prompt: Any, key: str) -> None:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise MalformedRow(f"{key!r} is empty")
        return
    if not isinstance(prompt, list) or not prompt:
        raise MalformedRow(f"{key!r} must be text or a non-empty list of chat messages")
    for message in prompt:
        if not (isinstance(message, dict) and "role" in message and "content" in message):
            raise MalformedRow(f"{key!r}: every chat message needs 'role' and 'content'")


def format_prompt(
    prompt: str | list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    tokenizer: Any = None,
    apply_chat_template: bool = True,
) -> tuple[str | list[dict[str, Any]], list[int] | None]:
    """(prompt text, token ids); the ids are None without a tokenizer."""
    if tokenizer is None:
        return prompt, None
    if apply_chat_template and hasattr(tokenizer, "apply_chat_template"):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise MalformedRow("chat messages need a tokenizer with a chat template")
    return text, list(tokenizer.encode(text, add_special_tokens=False))
