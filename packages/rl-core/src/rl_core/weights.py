"""Weights on their way from a trainer to the engines: byte-bounded buckets of named tensors."""

from collections.abc import Iterable, Iterator

import torch

from rl_core.protocols import WeightBucket

# The files of an HF model directory besides its config and weights (tokenizer, chat
# template, generation settings): what an exported or converted checkpoint copies from the
# directory it came from.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",
)


def bucket_by_bytes(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, bucket_bytes: int
) -> Iterator[WeightBucket]:
    """Group ``(name, tensor)`` pairs, in order, into lists of at most ``bucket_bytes``.

    A tensor larger than the bound travels alone. Tensors are consumed lazily, so a
    generator that gathers one full tensor at a time never holds more than one bucket.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: WeightBucket = []
    filled = 0
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if bucket and filled + size > bucket_bytes:
            yield bucket
            bucket, filled = [], 0
        bucket.append((name, tensor))
        filled += size
    if bucket:
        yield bucket
