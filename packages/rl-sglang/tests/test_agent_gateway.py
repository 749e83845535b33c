"""The agent gateway driven by the real ``openai`` client against real embedded engines
behind the router, and the external rollout buffer over HTTP."""

import asyncio
import json

import aiohttp
import openai
import pytest
from agent_tokenizers import chat_tokenizer

from conftest import run
from rl_core.types import Sample
from rl_sglang.agent.buffer import RolloutBuffer
from rl_sglang.agent.gateway import Gateway, parse_tool_calls
from rl_sglang.agent.rollout import AgentRollout
from rl_sglang.agent.streaming import merge_chunk
from rl_sglang.client import EngineClient
from rl_sglang.rollout.generate import GenerateContext

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


class Recording(EngineClient):
    """The router's client, keeping every /generate reply the engines sent (a streamed
    one as its chunks add up)."""

    def __init__(self, url):
        super().__init__(url)
        self.outputs = []

    async def generate(self, **body):
        output = await super().generate(**body)
        self.outputs.append((body["input_ids"], output))
        return output

    async def generate_stream(self, **body):
        output = None
        async for chunk in super().generate_stream(**body):
            output = merge_chunk(output, chunk)
            yield chunk
        self.outputs.append((body["input_ids"], output))


async def two_turn_agent(base_url, session_id, sample):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "user", "content": sample.prompt}]
    first = await client.chat.completions.create(
        model="policy",
        messages=messages,
        tools=TOOLS,
        max_tokens=6,
        extra_headers={"X-Session-Id": session_id},
    )
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "ab12"}]
    stream = await client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, stream=True, user=session_id
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    return float(len(text))


def test_agent_episode_trains_on_the_engines_ids_with_model_turns_masked(cluster):
    tok = chat_tokenizer()

    async def main():
        client = Recording(cluster.router.url)
        rollout = AgentRollout(two_turn_agent)
        ctx = GenerateContext(client=client, tokenizer=tok)
        params = {"max_new_tokens": 8, "temperature": 1.0}
        samples = await rollout(ctx, Sample(prompt="hi", label="x", index=3), params)
        await rollout.gateway.stop()
        await client.close()
        return samples, client.outputs

    [sample], outputs = run(main())
    (prompt1, out1), (prompt2, out2) = outputs
    ids1, ids2 = out1["output_ids"], out2["output_ids"]
    assert len(ids1) <= 6 and len(ids2) <= 8  # the client's max_tokens, under the rollout's
    assert prompt2[: len(prompt1) + len(ids1)] == prompt1 + ids1  # sampled ids kept
    assert sample.tokens == prompt2 + ids2
    assert sample.prompt_length == len(prompt1)
    glue = len(prompt2) - len(prompt1) - len(ids1)
    assert sample.loss_mask == [1] * len(ids1) + [0] * glue + [1] * len(ids2)
    engine_logprobs = [
        lp[0] for o in (out1, out2) for lp in o["meta_info"]["output_token_logprobs"]
    ]
    model_logprobs = [
        lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask, strict=False) if m
    ]
    assert model_logprobs == pytest.approx(engine_logprobs)
    assert sample.label == {"agent_reward": sample.reward} and sample.metadata["label"] == "x"
    user_turn = tok.encode("<|im_start|>user\nab12<|im_end|>", add_special_tokens=False)
    assert any(prompt2[i : i + len(user_turn)] == user_turn for i in range(len(prompt2)))


def test_gateway_needs_its_key_and_refuses_exposure_without_one(cluster):
    tok = chat_tokenizer()

    async def main():
        gateway = Gateway(EngineClient(cluster.router.url), tok, api_key="k1")
        url = await gateway.start()
        try:
            bad = openai.AsyncOpenAI(base_url=url, api_key="wrong")
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(
                    model="p", messages=[{"role": "user", "content": "hi"}], user="s"
                )
            good = openai.AsyncOpenAI(base_url=url, api_key="k1")
            with pytest.raises(openai.BadRequestError, match="no session"):
                await good.chat.completions.create(
                    model="p", messages=[{"role": "user", "content": "hi"}]
                )
            reply = await good.chat.completions.create(
                model="p", messages=[{"role": "user", "content": "hi"}], user="s", max_tokens=2
            )
            return reply, gateway.close("s")
        finally:
            await gateway.stop()
            await gateway.client.close()

    reply, samples = run(main())
    assert reply.usage.completion_tokens == samples[0].response_length
    with pytest.raises(ValueError, match="API key"):
        run(Gateway(None, tok).start(host="0.0.0.0"))


async def chat_twice(gateway, session_id, params, *, stream):
    """Two user turns of one session through the real client: each reply's content, the
    number of content chunks a streamed reply came in, and the session's samples."""
    client = openai.AsyncOpenAI(base_url=gateway.url, api_key="unused")
    gateway.open(session_id, params)
    messages, contents, num_chunks, finals = [{"role": "user", "content": "hi"}], [], [], []
    for _ in range(2):
        if stream:
            *chunks, usage = [
                c
                async for c in await client.chat.completions.create(
                    model="policy",
                    messages=messages,
                    stream=True,
                    user=session_id,
                    stream_options={"include_usage": True},
                )
            ]
            pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
            contents.append("".join(pieces))
            num_chunks.append(len(pieces))
            finals.append((chunks[-1].choices[0], usage.usage))
        else:
            reply = await client.chat.completions.create(
                model="policy", messages=messages, user=session_id
            )
            contents.append(reply.choices[0].message.content)
        messages += [
            {"role": "assistant", "content": contents[-1]},
            {"role": "user", "content": "ab12"},
        ]
    return contents, num_chunks, finals, gateway.close(session_id)


def test_streaming_relays_tokens_and_records_the_same_trajectory(cluster):
    tok = chat_tokenizer()
    params = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True}

    async def main():
        gateway = Gateway(EngineClient(cluster.engine_urls[0]), tok)
        await gateway.start()
        try:
            plain = await chat_twice(gateway, "plain", params, stream=False)
            streamed = await chat_twice(gateway, "streamed", params, stream=True)
            return plain, streamed, gateway.counts
        finally:
            await gateway.stop()
            await gateway.client.close()

    (texts, _, _, [plain]), (streamed_texts, num_chunks, finals, [streamed]), counts = run(main())
    assert streamed_texts == texts and all(texts)
    assert min(num_chunks) >= 3  # token by token, not the finished reply in one chunk
    assert [f.finish_reason for f, _ in finals] == ["length", "length"]
    (_, usage1), (last, usage2) = finals
    assert last.model_extra["token_ids"] == streamed.tokens[-24:]
    assert (usage1.prompt_tokens, usage1.completion_tokens) == (streamed.prompt_length, 24)
    assert usage2.prompt_tokens + usage2.completion_tokens == len(streamed.tokens)
    assert streamed.tokens == plain.tokens and streamed.prompt_length == plain.prompt_length
    assert streamed.loss_mask == plain.loss_mask and sum(plain.loss_mask) == 48
    assert streamed.rollout_log_probs == plain.rollout_log_probs
    assert streamed.weight_versions == plain.weight_versions
    assert streamed.status is plain.status and counts["stream_text_mismatches"] == 0


def test_an_unknown_tool_parser_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown tool parser 'mistral'.*'hermes', 'llama3_json'"):
        Gateway(None, chat_tokenizer(), tool_parser="mistral")


def test_tool_calls_are_parsed_and_bad_ones_counted():
    content, calls, invalid = parse_tool_calls(
        'ok <tool_call>{"name": "calc", "arguments": {"e": "1+2"}}</tool_call>'
        "<tool_call>{not json}</tool_call>"
    )
    assert content == "ok"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("calc", {"e": "1+2"})
    ]
    assert invalid == 1


def good_group(name, reward=1.0):
    return {
        "group": name,
        "samples": [
            {"tokens": [1, 2, 3, 4], "prompt_length": 2, "reward": reward, "loss_mask": [1, 0]},
            {"tokens": [1, 2, 5], "prompt_length": 2, "reward": 0.0},
        ],
    }


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ("[1]", "expected a JSON object"),
        ({"group": "g", "samples": []}, "samples: expected a non-empty list"),
        (
            {"group": "g", "samples": [{"tokens": [1, 2], "prompt_length": 2, "reward": 1}]},
            "prompt_length: expected an int in 1..1",
        ),
        (
            {"group": "g", "samples": [{"tokens": [1, 2], "prompt_length": 1, "reward": "x"}]},
            "reward: expected a finite number",
        ),
        (
            {
                "group": "g",
                "samples": [
                    {"tokens": [1, 2, 3], "prompt_length": 1, "reward": 1, "loss_mask": [1]}
                ],
            },
            "loss_mask: expected a list of 2",
        ),
        ("{not json", "not JSON"),
    ],
)
def test_bad_buffer_writes_get_400_with_the_reason_and_are_counted(tmp_path, payload, reason):
    async def main():
        buffer = RolloutBuffer(tmp_path / "buffer.json")
        url = await buffer.start()
        data = payload if isinstance(payload, str) else json.dumps(payload)
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/buffer/write", data=data) as response,
        ):
            status, body = response.status, await response.json()
        await buffer.stop()
        return status, body, buffer.counts

    status, body, counts = run(main())
    assert status == 400 and reason in body["error"]
    assert counts["rejected"] == 1 and counts["accepted"] == 0


def test_buffer_keeps_unserved_groups_across_a_restart_and_collects_by_ratio(tmp_path):
    path = tmp_path / "buffer.json"

    async def first_life():
        buffer = RolloutBuffer(path, api_key="k")
        url = await buffer.start()
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer k"}) as http:
            for name in ("a", "b", "c"):
                async with http.post(url + "/buffer/write", json=good_group(name)) as r:
                    assert r.status == 200
        async with (
            aiohttp.ClientSession() as http,  # no key
            http.post(url + "/buffer/write", json=good_group("d")) as r,
        ):
            assert r.status == 401
        [served] = await buffer.collect(1)
        await buffer.stop()
        return served

    served = run(first_life())
    assert [s.metadata["buffer_group"] for s in served] == ["a", "a"]
    assert served[0].loss_mask == [1, 0] and served[0].response_length == 2

    async def second_life():  # a new trainer process: b and c are still there
        buffer = RolloutBuffer(path)
        assert list(buffer.pending) == ["b", "c"]
        start = asyncio.get_running_loop().time()
        groups = await buffer.collect(4, min_ratio=0.5, timeout_s=1.0)
        waited = asyncio.get_running_loop().time() - start
        with pytest.raises(TimeoutError, match=r"fewer than min_ratio=0\.5 of 4"):
            await buffer.collect(4, min_ratio=0.5, timeout_s=0.2)
        return groups, waited

    groups, waited = run(second_life())
    assert [g[0].metadata["buffer_group"] for g in groups] == ["b", "c"]
    assert 0.9 <= waited < 10
    assert json.loads(path.read_text())["pending"] == {}


def test_buffer_served_groups_wait_for_settling_and_return_after_a_restart(tmp_path):
    path = tmp_path / "buffer.json"
    buffer = RolloutBuffer(path, until_settled=True)
    for name in "abcd":
        buffer.write(good_group(name))
    first, second = buffer.take(1), buffer.take(2)
    assert buffer.write(good_group("a")) == 0  # served, not settled: still a duplicate
    assert [s.metadata["buffer_serve"] for s in first[0]] == [1, 1]
    assert [g[0].metadata["buffer_serve"] for g in second] == [2, 3]
    buffer.settle(1)  # a checkpoint holds the training on group "a"
    restarted = RolloutBuffer(path, until_settled=True)  # b and c were served, not saved
    assert [entry[1] for entry in restarted.served] == ["b", "c"]
    assert restarted.requeue_after(2) == 1  # the resumed checkpoint trained "b" too
    assert list(restarted.pending) == ["c", "d"]
    again = restarted.take(2)
    assert [g[0].metadata["buffer_group"] for g in again] == ["c", "d"]
    assert [g[0].metadata["buffer_serve"] for g in again] == [4, 5]
    assert json.loads(path.read_text())["num_served"] == 5
