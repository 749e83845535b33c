"""Multi-turn SFT loss masks from a chat template: train every assistant turn (its content,
tool calls and end-of-turn token), nothing else (system, user and tool turns, the
template's generation prompt ``<|im_start|>assistant\\n`` and the glue it writes after an
end-of-turn, such as ChatML's newline).

    ids, mask = chat_loss_mask(tokenizer, messages, tools=tools)

Works for templates that render a conversation's prefix as a prefix of the whole (ChatML:
Qwen2, Qwen2.5, SmolLM2; Llama 3; Qwen3 without reasoning in earlier turns); one that does
not (e.g. a template that drops earlier turns' reasoning) is refused with a ValueError
naming the turn, rather than masked wrongly.
"""

from rl_sglang.agent.sessions import for_template


def _render(tokenizer, messages, tools, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        for_template(messages),
        tools=tools or None,
        tokenize=False,
        add_generation_prompt=generation_prompt,
    )


def assistant_spans(tokenizer, messages: list[dict], tools=None, *, end_token: str | None = None):
    """``(text, [(start, end), ...])``: the rendered conversation and the character spans
    of the model's own turns (after the generation prompt, through ``end_token``, default
    the tokenizer's EOS)."""
    end_token = end_token or tokenizer.eos_token
    text, spans = _render(tokenizer, messages, tools, False), []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], tools, True) if i else ""
        after = _render(tokenizer, messages[: i + 1], tools, False)
        if not (after.startswith(before) and text.startswith(after)):
            raise ValueError(
                f"the chat template renders the conversation up to message {i} differently "
                "inside the whole conversation, so its turns cannot be masked one by one; "
                "use a template that renders history unchanged (or train on the last turn only)"
            )
        end = after.rfind(end_token, len(before))
        spans.append((len(before), end + len(end_token) if end >= 0 else len(after)))
    return text, spans


def chat_loss_mask(tokenizer, messages: list[dict], tools=None, *, end_token: str | None = None):
    """``(token ids, loss mask)`` of the conversation: 1 on tokens starting inside an
    assistant span (:func:`assistant_spans`), 0 elsewhere. Needs a fast tokenizer."""
    text, spans = assistant_spans(tokenizer, messages, tools, end_token=end_token)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [
        int(any(start <= begin < end for start, end in spans))
        for begin, _ in encoded["offset_mapping"]
    ]
    return list(encoded["input_ids"]), mask
