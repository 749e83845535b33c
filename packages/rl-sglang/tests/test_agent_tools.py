"""Tool-call parsers (Hermes, Llama 3 JSON) on written-out replies, the streamed content
deltas they allow, and SGLang's two stream layouts merged into one /generate output."""

import json

import pytest
from agent_tokenizers import chat_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rl_sglang.agent.gateway import Gateway
from rl_sglang.agent.streaming import ContentDeltas, IncrementalText, merge_chunk
from rl_sglang.agent.tools import TOOL_PARSERS, detect_tool_parser

LLAMA = TOOL_PARSERS["llama3_json"]
HERMES = TOOL_PARSERS["hermes"]


def named(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        ('{"name": "calc", "parameters": {"e": "1+2"}}', [("calc", {"e": "1+2"})]),
        ('\n<|python_tag|>{"name": "calc", "parameters": {}}', [("calc", {})]),
        (
            '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": [2]}}',
            [("a", {"x": 1}), ("b", {"y": [2]})],
        ),
    ],
)
def test_llama3_json_calls_become_openai_tool_calls(text, calls):
    content, parsed, invalid = LLAMA.parse(text)
    assert named(parsed) == calls and content == "" and invalid == 0
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed)


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "calc", "parameters": {"e": 1}',  # cut off
        '{"parameters": {"e": 1}}',  # no name
        '{"name": 3, "parameters": {}}',
        '{"name": "calc", "parameters": [1]}',  # arguments not an object
        '{"name": "calc", "parameters": {}} and then some prose',
        '{"name": "a", "parameters": {}}; {"oops": 1}',  # one bad call spoils the reply
        "<|python_tag|>print(6 * 7)",  # code, not JSON
        "<|python_tag|>",
    ],
)
def test_malformed_llama3_calls_stay_content_and_count_once(text):
    assert LLAMA.parse(text) == (text, [], 1)


def test_llama3_prose_is_content_and_not_an_attempted_call():
    text = 'The result is {"x": 1}'
    assert LLAMA.parse(text) == (text, [], 0)


def test_hermes_keeps_leading_content_and_counts_bad_blocks():
    text = ' ok <tool_call>{"name": "calc", "arguments": {"e": "1"}}</tool_call>\n'
    content, calls, invalid = HERMES.parse(text + "<tool_call>{bad}</tool_call> done ")
    assert content == " ok \n done" and named(calls) == [("calc", {"e": "1"})] and invalid == 1
    assert HERMES.parse("<tool_call>{bad}</tool_call>") == ("<tool_call>{bad}</tool_call>", [], 1)


@pytest.mark.parametrize(
    ("family", "parser"), [("chatml", "hermes"), ("qwen3", "hermes"), ("llama3", "llama3_json")]
)
def test_the_chat_template_picks_the_parser(family, parser):
    tok = chat_tokenizer(family)
    assert detect_tool_parser(tok) == parser
    assert Gateway(None, tok).parser is TOOL_PARSERS[parser]


def reply(tok, text, finish="stop"):
    ids = tok.encode(text, add_special_tokens=False)
    return {"output_ids": ids, "meta_info": {"finish_reason": {"type": finish}}}


def test_a_llama_gateway_replies_with_tool_calls_or_counted_plain_content():
    tok = chat_tokenizer("llama3")
    gateway = Gateway(None, tok)
    message, finish = gateway._reply(reply(tok, '{"name": "calc", "parameters": {"e": "2"}}'))
    assert finish == "tool_calls" and message["content"] is None
    assert named(message["tool_calls"]) == [("calc", {"e": "2"})]
    bad = '{"name": "calc", "parameters": {"e": '
    message, finish = gateway._reply(reply(tok, bad + "<|eot_id|>", finish="length"))
    assert message == {"role": "assistant", "content": bad} and finish == "length"
    assert gateway.counts["tool_calls"] == 1 and gateway.counts["invalid_tool_calls"] == 1


def streamed(parser, tok, text):
    """The content deltas of ``text`` decoded token by token, and the final content."""
    ids, deltas = tok.encode(text, add_special_tokens=False), ContentDeltas(parser)
    incremental = IncrementalText(lambda some: tok.decode(some, skip_special_tokens=True))
    pieces = [deltas.delta(incremental.update(ids[:n])) for n in range(1, len(ids) + 1)]
    content = parser.parse(tok.decode(ids, skip_special_tokens=True))[0]
    return [p for p in pieces if p], deltas.rest(content), content


def metaspace_tokenizer():
    """Words with SentencePiece's leading ``▁``: a word decoded alone loses its space."""
    words = ["<unk>", "▁Hello", "▁world", "▁again", "▁", "!"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=core)


WORDS = "Hello world again world Hello again world Hello world again"


@pytest.mark.parametrize(
    ("tok", "text", "whole"),
    [
        (metaspace_tokenizer(), WORDS, WORDS),
        (chat_tokenizer(), "naïve € 12ab<|im_end|>\U0001f600 end", "naïve € 12ab\U0001f600 end"),
    ],
)  # 2-, 3- and 4-byte characters in the byte-level one
def test_incremental_text_adds_up_to_the_whole_decode_reading_few_ids(tok, text, whole):
    ids, windows = tok.encode(text, add_special_tokens=False), []

    def decode(some):
        windows.append(len(some))
        return tok.decode(some, skip_special_tokens=True)

    incremental = IncrementalText(decode)
    texts = [incremental.update(ids[:n]) for n in range(1, len(ids) + 1)]
    assert texts[-1] == whole == tok.decode(ids, skip_special_tokens=True)
    assert all(whole.startswith(t) for t in texts)
    assert max(windows) <= 8 < len(ids)  # a few ids at a time, never the whole reply
    one_by_one = "".join(tok.decode([i], skip_special_tokens=True) for i in ids)
    assert one_by_one != whole  # what decoding each token alone would get wrong


def test_streamed_hermes_content_never_shows_the_call_and_adds_up():
    tok = chat_tokenizer()
    text = 'Let me compute é.  \n<tool_call>{"name": "calc", "arguments": {}}</tool_call>\nok'
    pieces, rest, content = streamed(HERMES, tok, text)
    assert "".join(pieces) == "Let me compute é." and len(pieces) >= 10
    assert all("\ufffd" not in p and "<" not in p for p in pieces)  # é is two bytes
    assert "".join(pieces) + rest == content == "Let me compute é.  \n\nok"


@pytest.mark.parametrize(
    ("text", "sent_before_end"),
    [
        ('<|python_tag|>{"name": "calc", "parameters": {"e": "1"}}', ""),
        ('  {"name": "calc", "parameters": {"e": ', ""),  # malformed: all at the end
        ("Hi {there}", "Hi {there}"),
    ],
)
def test_streamed_llama_replies_hold_back_what_may_be_a_call(text, sent_before_end):
    pieces, rest, content = streamed(LLAMA, chat_tokenizer("llama3"), text)
    assert "".join(pieces) == sent_before_end
    assert "".join(pieces) + rest == content


def chunk(ids, logprobs, completion_tokens, finish=None):
    return {
        "output_ids": ids,
        "meta_info": {
            "completion_tokens": completion_tokens,
            "finish_reason": finish,
            "weight_version": "2",
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)],
        },
    }


def test_cumulative_and_incremental_streams_merge_to_the_same_output():
    done = {"type": "stop"}
    cumulative = [
        chunk([7], [-0.1], 1),
        chunk([7, 8], [-0.1, -0.2], 2),
        chunk([7, 8, 9], [-0.1, -0.2, -0.3], 3, done),
    ]
    incremental = [chunk([7], [-0.1], 1), chunk([8], [-0.2], 2), chunk([9], [-0.3], 3, done)]
    merged = []
    for chunks in (cumulative, incremental):
        output = None
        for piece in chunks:
            output = merge_chunk(output, piece)
        merged.append(output)
    assert merged[0] == merged[1]
    assert merged[1]["output_ids"] == [7, 8, 9]
    assert [e[0] for e in merged[1]["meta_info"]["output_token_logprobs"]] == [-0.1, -0.2, -0.3]
    assert merged[1]["meta_info"]["finish_reason"] == done
