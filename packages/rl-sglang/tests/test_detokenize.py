"""text_decoder gives the text tokenizer.decode gives, with and without special tokens, for
the tokenizers rollouts use; a tokenizer that cleans up spaces keeps its own decode."""

import random
from pathlib import Path

import pytest
from agent_tokenizers import chat_tokenizer

from rl_sglang.detokenize import text_decoder
from rl_sglang.tiny import byte_tokenizer

QUICKSTART = Path(__file__).resolve().parents[3] / "examples/quickstart/tokenizer"


def quickstart_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(QUICKSTART))


@pytest.mark.parametrize("make", [byte_tokenizer, chat_tokenizer, quickstart_tokenizer])
def test_the_same_text_as_decode_on_random_ids_with_special_tokens(make):
    tokenizer, draw = make(), random.Random(0)
    decode = text_decoder(tokenizer)
    assert decode is not tokenizer.decode  # the fast path is taken
    specials = tokenizer.all_special_ids
    for length in [0, 1, 2, 5, 24, 64, 300]:
        ids = [draw.randrange(len(tokenizer)) for _ in range(length)]
        for special in specials:  # each at a random place
            ids.insert(draw.randrange(len(ids) + 1), special)
        for skip in (False, True):
            assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip
            )
        assert decode(ids) == tokenizer.decode(ids)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode():
    tokenizer = byte_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    assert text_decoder(tokenizer) == tokenizer.decode


def test_a_tokenizer_without_a_rust_backend_keeps_its_own_decode():
    class Plain:
        def decode(self, ids, skip_special_tokens=False):
            return ",".join(map(str, ids))

    plain = Plain()
    assert text_decoder(plain)([1, 2]) == "1,2"
