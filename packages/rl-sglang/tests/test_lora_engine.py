"""LoRA adapters on the embedded engine, over its HTTP API (SGLang's /load_lora_adapter,
/unload_lora_adapter and ``lora_path`` per request): a request naming an adapter decodes
as the model with the adapter merged into its weights, a batch mixes adapted and base rows,
an unloaded adapter is refused, and bad payloads get a 400 with the reason."""

import asyncio
import copy

import pytest
import torch
from aiohttp import web

from conftest import teacher_forced_logprobs
from rl_sglang.client import EngineClient, EngineError
from rl_sglang.embedded import make_app
from rl_sglang.engine import lora
from rl_sglang.engine.core import Engine
from rl_sglang.tiny import byte_tokenizer, random_model, tiny_config

RANK, ALPHA = 4, 8.0
TARGETS = ("q_proj", "v_proj", "down_proj")
PROMPTS = [[10, 20, 30, 40], [7, 8, 9]]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def random_adapter(model, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return lora.random_adapter(model, rank=RANK, targets=TARGETS, seed=seed, scale=0.3)


def write_peft(path, adapter) -> str:
    return lora.save_peft_adapter(path, adapter, rank=RANK, alpha=ALPHA)


def merged(model, adapter):
    """A copy of ``model`` with ``W + alpha / r * B @ A`` in each adapted Linear."""
    copied = copy.deepcopy(model)
    modules = dict(copied.named_modules())
    with torch.no_grad():
        for name, (a, b) in adapter.items():
            modules[name].weight += (ALPHA / RANK) * b @ a
    return copied


@pytest.fixture(scope="module")
def base():
    return random_model(tiny_config(), seed=0)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    made = {name: random_adapter(base, seed) for name, seed in (("one", 1), ("two", 2))}
    return {name: (weights, write_peft(root / name, weights)) for name, weights in made.items()}


async def serving(model, body_fn, **engine_options):
    """Serve a copy of ``model`` (adapter hooks go on its Linears) over HTTP on loopback
    and return ``await body_fn(client)``."""
    model = copy.deepcopy(model)
    engine = Engine(model, byte_tokenizer(), max_batch_size=8, **engine_options)
    runner = web.AppRunner(make_app(engine))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with EngineClient(f"http://127.0.0.1:{port}") as client:
            return await body_fn(client)
    finally:
        await runner.cleanup()
        engine.scheduler.stop()


def logprobs_of(out) -> list[float]:
    return [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]


def greedy(client, **extra):
    return client.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, **extra)


def test_adapted_rows_decode_as_the_merged_model_and_base_rows_as_the_base(base, adapters):
    (one, one_path), (two, two_path) = adapters["one"], adapters["two"]

    async def adapted(client):
        loaded = await client.load_lora_adapter("one", one_path)
        assert loaded["loaded_adapters"] == {"one": one_path}
        await client.load_lora_adapter("two", two_path)
        alone = await greedy(client, lora_path="one")
        mixed = await greedy(client, lora_path=["two", None])
        client.lora_path = "one"  # the client's default adapter
        by_default = await greedy(client)
        await client.unload_lora_adapter("one")
        with pytest.raises(EngineError, match="'one' is not loaded"):
            await greedy(client, lora_path="one")
        info = await client.server_info()
        return alone, mixed, by_default, info

    alone, mixed, by_default, info = asyncio.run(serving(base, adapted, enable_lora=True))
    assert info["loaded_adapters"] == {"two": two_path} and info["runner"] == "dynamic"
    references = {"one": merged(base, one), "two": merged(base, two), None: base}
    for out, prompt, name in [
        (alone[0], PROMPTS[0], "one"),
        (alone[1], PROMPTS[1], "one"),
        (mixed[0], PROMPTS[0], "two"),
        (mixed[1], PROMPTS[1], None),
        (by_default[0], PROMPTS[0], "one"),
    ]:
        expected = teacher_forced_logprobs(references[name], prompt, out["output_ids"])
        assert logprobs_of(out) == pytest.approx(expected, abs=1e-4), name
        # greedy: each token is the reference's argmax after the tokens before it
        ids = torch.tensor([prompt + out["output_ids"]])
        with torch.no_grad():
            argmax = references[name](ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
        assert out["output_ids"] == argmax.tolist(), name
    assert alone[0]["output_ids"] != mixed[1]["output_ids"] or logprobs_of(
        alone[0]
    ) != pytest.approx(logprobs_of(mixed[1]), abs=1e-3)  # the adapter changed the output


def test_prompt_logprobs_with_an_adapter_are_the_merged_models(base, adapters):
    one, one_path = adapters["one"]
    ids = PROMPTS[0] + [50, 60, 70]

    async def score(client):
        await client.load_lora_adapter("one", one_path)
        client.lora_path = "one"
        return await client.prompt_logprobs(ids)

    scores = asyncio.run(serving(base, score, enable_lora=True))
    expected = teacher_forced_logprobs(merged(base, one), ids[:1], ids[1:])
    assert scores == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize(
    ("path", "body", "reason"),
    [
        ("/load_lora_adapter", {"lora_path": "x"}, "needs 'lora_name'"),
        ("/load_lora_adapter", {"lora_name": "a"}, "needs 'lora_path'"),
        ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"}, "no adapter_config"),
        ("/load_lora_adapter", {"lora_name": "one", "lora_path": "ONE"}, "loaded already"),
        ("/load_lora_adapter", {"lora_name": "big", "lora_path": "BIG"}, "exceeds --max-lora-rank"),
        ("/unload_lora_adapter", {"lora_name": "never"}, "'never' is not loaded"),
        ("/generate", {"input_ids": [1, 2], "lora_path": "never"}, "not loaded"),
        ("/generate", {"input_ids": [[1], [2]], "lora_path": ["one"]}, "1 entries for 2"),
        ("/update_weight_version", {}, "needs 'new_version'"),
    ],
)
def test_bad_payloads_get_400_with_the_reason(base, adapters, tmp_path, path, body, reason):
    one_path = adapters["one"][1]
    paths = {"ONE": one_path, "BIG": str(tmp_path / "big")}
    body = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in body.items()}

    async def send(client):
        await client.load_lora_adapter("one", one_path)
        write_big(tmp_path / "big", adapters["one"][0])
        async with client.session.post(client.url + path, json=body) as response:
            return response.status, await response.json()

    status, answer = asyncio.run(serving(base, send, enable_lora=True, max_lora_rank=RANK))
    assert status == 400 and answer["success"] is False
    assert reason in answer["error_message"]


def write_big(path, adapter) -> None:
    """A rank-16 PEFT adapter (over the engine's --max-lora-rank)."""
    zeros = {
        m: (torch.zeros(16, a.shape[1]), torch.zeros(b.shape[0], 16))
        for m, (a, b) in adapter.items()
    }
    lora.save_peft_adapter(path, zeros, rank=16, alpha=16)


def test_an_engine_without_lora_refuses_adapters(base, adapters):
    async def send(client):
        with pytest.raises(EngineError, match="--enable-lora"):
            await client.load_lora_adapter("one", adapters["one"][1])
        with pytest.raises(EngineError, match="--enable-lora"):
            await greedy(client, lora_path="one")
        return await greedy(client)  # the base still serves

    outs = asyncio.run(serving(base, send))
    assert len(outs) == 2


def test_an_adapter_for_modules_the_engine_does_not_target_is_refused(base, adapters):
    async def send(client):
        with pytest.raises(EngineError, match="not a LoRA target"):
            await client.load_lora_adapter("one", adapters["one"][1])

    asyncio.run(serving(base, send, enable_lora=True, lora_targets=("q_proj",)))
