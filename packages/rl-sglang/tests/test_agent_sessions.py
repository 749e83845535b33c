"""Trajectory trees and SFT masks, against hand-marked token ids (no engine: the engine's
replies are written out, so each expected id is known)."""

import pytest
from agent_tokenizers import chat_tokenizer

from rl_core.types import SampleStatus
from rl_sglang.agent.masks import chat_loss_mask
from rl_sglang.agent.sessions import Session


def reply(ids, *, version="1", finish="stop"):
    """An engine /generate reply for ``ids`` with log-prob -0.5 - i/10 for token i."""
    logprobs = [[-0.5 - i / 10, t, None] for i, t in enumerate(ids)]
    return {
        "output_ids": list(ids),
        "meta_info": {
            "output_token_logprobs": logprobs,
            "weight_version": version,
            "finish_reason": {"type": finish},
        },
    }


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


USER = {"role": "user", "content": "hi"}


def test_a_turn_continues_from_the_sampled_ids_not_a_retokenisation():
    tok = chat_tokenizer()
    session = Session(tok)
    first = session.prompt([USER])
    assert first.input_ids == ids(tok, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    sampled = [ord("a"), ord("b"), 258]  # 'a', 'b', <|im_end|>: re-encoding "ab" gives [259]
    assert ids(tok, tok.decode(sampled[:2])) == [259]
    session.record(first, reply(sampled), {"role": "assistant", "content": "ab"})
    second = session.prompt(
        [USER, {"role": "assistant", "content": "ab"}, {"role": "user", "content": "12"}]
    )
    glue = ids(tok, "\n<|im_start|>user\n12<|im_end|>\n<|im_start|>assistant\n")
    assert second.input_ids == first.input_ids + sampled + glue
    assert 260 in glue  # the user's "12" is tokenised (merged) once, as the template's text
    session.record(
        second,
        reply([ord("x")], version="2", finish="length"),
        {"role": "assistant", "content": "x"},
    )
    [sample] = session.samples()
    prompt = len(first.input_ids)
    assert sample.tokens == [*second.input_ids, ord("x")]
    assert sample.prompt_length == prompt
    assert sample.loss_mask == [1, 1, 1] + [0] * len(glue) + [1]
    assert sample.rollout_log_probs == pytest.approx(
        [-0.5, -0.6, -0.7] + [0.0] * len(glue) + [-0.5]
    )
    assert sample.weight_versions == ["1", "2"]
    assert sample.status is SampleStatus.TRUNCATED
    assert sample.metadata["turns"] == 2


def test_stopping_without_the_end_token_gets_it_as_masked_glue():
    tok = chat_tokenizer()
    session = Session(tok)
    first = session.prompt([USER])
    session.record(first, reply([ord("z")]), {"role": "assistant", "content": "z"})  # stop string
    second = session.prompt([USER, {"role": "assistant", "content": "z"}, USER])
    tail = ids(tok, "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert second.input_ids == [*first.input_ids, ord("z"), *tail]
    assert second.mask[len(first.input_ids) :] == [1] + [0] * len(tail)


def test_rewritten_history_forks_and_every_leaf_is_a_sample():
    tok = chat_tokenizer()
    session = Session(tok)
    t1 = session.prompt([USER])
    session.record(t1, reply([ord("p"), 258]), {"role": "assistant", "content": "p"})
    history = [USER, {"role": "assistant", "content": "p"}]
    t2 = session.prompt([*history, {"role": "user", "content": "q"}])
    session.record(t2, reply([ord("r"), 258]), {"role": "assistant", "content": "r"})
    t3 = session.prompt([*history, {"role": "user", "content": "s"}])  # rewrites turn 2
    assert t3.parent is t2.parent  # forks after the first reply
    session.record(t3, reply([ord("t"), 258]), {"role": "assistant", "content": "t"})
    t4 = session.prompt([{"role": "user", "content": "other"}])  # diverges at the start
    assert t4.parent is None
    session.record(t4, reply([ord("u"), 258]), {"role": "assistant", "content": "u"})
    samples = session.samples()
    assert session.forks == 1
    assert [s.response for s in samples] == [
        "p<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nr<|im_end|>",
        "p<|im_end|>\n<|im_start|>user\ns<|im_end|>\n<|im_start|>assistant\nt<|im_end|>",
        "u<|im_end|>",
    ]
    assert [s.tokens[-2] for s in samples] == [ord("r"), ord("t"), ord("u")]
    assert [sum(s.loss_mask) for s in samples] == [4, 4, 2]  # two replies of 2 ids; one
    assert samples[0].tokens[: len(t2.input_ids)] == t2.input_ids


def test_an_echoed_assistant_message_with_tool_calls_matches_its_turn():
    tok = chat_tokenizer()
    session = Session(tok)
    t1 = session.prompt([USER], tools=[{"type": "function", "function": {"name": "calc"}}])
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "calc", "arguments": '{"e": "1+2"}'},
    }
    session.record(
        t1, reply([ord("c"), 258]), {"role": "assistant", "content": None, "tool_calls": [call]}
    )
    echoed = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [{**call, "function": {"name": "calc", "arguments": '{"e":"1+2"}'}}],
    }
    t2 = session.prompt(
        [USER, echoed, {"role": "tool", "tool_call_id": "c1", "content": "3"}],
        tools=[{"type": "function", "function": {"name": "calc"}}],
    )
    assert t2.parent is not None
    assert t2.input_ids[len(t1.input_ids) : len(t1.input_ids) + 2] == [ord("c"), 258]


TOOL_CHAT = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "q"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c", "content": "2"},
    {"role": "assistant", "content": "ok"},
]


@pytest.mark.parametrize(
    ("family", "marked"),
    [
        (
            "chatml",
            "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
            '<|im_start|>assistant\n[<tool_call>{"name": "f", "arguments": {"x": 1}}'
            "</tool_call><|im_end|>]\n<|im_start|>user\n<tool_response>2</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n[ok<|im_end|>]\n",
        ),
        (
            "qwen3",
            "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
            '<|im_start|>assistant\n<think>\n\n</think>\n\n[<tool_call>{"name": "f", '
            '"arguments": {"x": 1}}</tool_call><|im_end|>]\n<|im_start|>user\n'
            "<tool_response>2</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n"
            "</think>\n\n[ok<|im_end|>]\n",
        ),
        (
            "llama3",
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\ns<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nq<|eot_id|><|start_header_id|>assistant"
            '<|end_header_id|>\n\n[{"name": "f", "parameters": {"x": 1}}<|eot_id|>]'
            "<|start_header_id|>ipython<|end_header_id|>\n\n2<|eot_id|><|start_header_id|>"
            "assistant<|end_header_id|>\n\n[ok<|eot_id|>]",
        ),
    ],
)
def test_sft_masks_train_only_the_model_turns(family, marked):
    """``[...]`` marks, by hand, the text the model writes: its turns and their end token,
    not the generation prompt (the think block included), tool results or glue."""
    tok = chat_tokenizer(family)
    expected_ids, expected_mask = [], []
    for number, part in enumerate(marked.replace("]", "[").split("[")):
        part_ids = ids(tok, part)
        expected_ids += part_ids
        expected_mask += [number % 2] * len(part_ids)
    got_ids, mask = chat_loss_mask(tok, TOOL_CHAT)
    assert got_ids == expected_ids
    assert mask == expected_mask


def test_a_template_that_rewrites_history_is_refused():
    tok = chat_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m.content if loop.last else 'x' }}{% endfor %}"
    with pytest.raises(ValueError, match="renders the conversation up to message"):
        chat_loss_mask(tok, [USER, {"role": "assistant", "content": "a"}, USER])
