"""Tiny causal LMs with a byte-level tokenizer, built locally (no hub download).

Used by the tests, the examples and ``bench/engine.py`` on CPU: a Qwen2-shaped model with
random weights saved as an HF directory (config, safetensors, tokenizer) that the
embedded engine and ``AutoModelForCausalLM.from_pretrained`` both load.
"""

from pathlib import Path
from typing import Any

import torch

EOS_TOKEN = "<|endoftext|>"
NUM_BYTES = 256


def byte_tokenizer():
    """A fast HF tokenizer with one token per byte (ids 0..255) and EOS = 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=_byte_of_char)
    vocab = {char: index for index, char in enumerate(byte_chars)}
    vocab[EOS_TOKEN] = NUM_BYTES
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def _byte_of_char(char: str) -> int:
    """GPT-2's byte-to-unicode map, inverted for one character."""
    code = ord(char)
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def tiny_config(**overrides: Any):
    """A Qwen2 config with hidden 64, 2 layers, vocab 320 (bytes + EOS + spare ids)."""
    from transformers import Qwen2Config

    settings = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=NUM_BYTES,
        pad_token_id=NUM_BYTES,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return Qwen2Config(**settings)


def random_model(config, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """An ``AutoModelForCausalLM`` of ``config`` with seeded random weights, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # the default init is near-uniform; a wider spread makes outputs varied
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
    return model.eval()


def save_tiny_model(path: str | Path, *, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a tiny random model and the byte tokenizer as an HF directory; returns it."""
    path = Path(path)
    model = random_model(tiny_config(**config_overrides), seed=seed)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path
