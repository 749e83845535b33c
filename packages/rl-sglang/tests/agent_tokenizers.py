"""Byte-level test tokenizers with the chat templates of the families we support, written
here (ChatML as Qwen2 / Qwen2.5 / SmolLM2 use it, with Hermes tool calls; Qwen3's empty
think block; Llama 3's headers). ``ab`` and ``12`` are merged tokens, so decoding sampled
bytes and encoding the text again is not the identity."""

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rl_sglang.tiny import NUM_BYTES, byte_tokenizer

CHATML = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{ '<tool_call>' + ({'name': c.function.name, 'arguments': c.function.arguments} | tojson) + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN3 = CHATML.replace(
    "{{ '<|im_start|>assistant\\n' + (m.content or '') }}",
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + (m.content or '') }}",
).replace(
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}",
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}",
)
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}"
    "{%- for m in messages %}"
    "{%- set role = 'ipython' if m.role == 'tool' else m.role %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{ ({'name': c.function.name, 'parameters': c.function.arguments} | tojson) }}{% endfor %}"
    "{{ '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
SPECIALS = {
    "chatml": ["<|im_start|>", "<|im_end|>"],
    "qwen3": ["<|im_start|>", "<|im_end|>"],
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
}
TEMPLATES = {"chatml": CHATML, "qwen3": QWEN3, "llama3": LLAMA3}


def chat_tokenizer(family: str = "chatml") -> PreTrainedTokenizerFast:
    """Bytes 0..255, EOS 256, the family's special tokens from 257, then ``ab`` and ``12``
    (all below the tiny model's vocab of 320); EOS is the family's end of turn."""
    base = byte_tokenizer()
    vocab = dict(base.backend_tokenizer.get_vocab())
    for token in [*SPECIALS[family], "ab", "12"]:
        vocab[token] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("1", "2")]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIALS[family]]
    )
    end = SPECIALS[family][1] if family != "llama3" else "<|eot_id|>"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=end, pad_token=end)
    tokenizer.chat_template = TEMPLATES[family]
    assert tokenizer.convert_tokens_to_ids(SPECIALS[family][0]) == NUM_BYTES + 1
    return tokenizer
