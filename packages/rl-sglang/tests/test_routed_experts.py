"""The embedded engine's ``return_routed_experts`` (SGLang's routed-experts output, for
rollout routing replay): a Qwen3-MoE engine, and a DeepSeek-V3 one (sigmoid router with
groups; its first layer dense, whose rows hold 0), returns, for every token it ran (prompt
and output but the last), the experts of each layer, equal to a full HF forward's router
choices; and it refuses the field when not started for it."""

import pytest
import torch
from test_families import PROMPTS, family_model

from conftest import generate
from rl_core.routing import decode_routes, hf_moe_routers
from rl_sglang.engine.core import Engine
from rl_sglang.tiny import byte_tokenizer


def decisive_moe_model(family: str = "qwen3_moe"):
    """The families' tiny Qwen3-MoE (2 layers, 4 experts, top-2) or DeepSeek-V3 (a dense
    layer, then 8 experts in 4 groups, top-4) with router weights scaled up, so no token's
    top-k is a near tie that float rounding (cached decode vs a full forward) could flip."""
    model = family_model(family)
    with torch.no_grad():
        for router in hf_moe_routers(model).values():
            router.weight.normal_(0.0, 1.0)
    return model


def forward_routes(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids), L, K]``: each layer's experts of each token in one forward."""
    kept = {}
    handles = [
        router.register_forward_hook(lambda m, a, out, i=i: kept.__setitem__(i, out[2]))
        for i, router in hf_moe_routers(model).items()
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([kept[i] for i in sorted(kept)], dim=1)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_routes_cover_every_token_run_and_equal_a_full_forward(family):
    model = decisive_moe_model(family)
    layers, top_k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    moe_layers = sorted(hf_moe_routers(model))
    engine = Engine(
        model, byte_tokenizer(), max_batch_size=4, max_context=64, enable_return_routed_experts=True
    )
    try:
        params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "n": 2}
        outs = generate(
            engine, input_ids=PROMPTS[:3], sampling_params=params, return_routed_experts=True
        )
    finally:
        engine.scheduler.stop()
    prompts = [p for p in PROMPTS[:3] for _ in range(2)]
    for prompt, out in zip(prompts, outs, strict=True):
        ids = prompt + out["output_ids"]
        routes = decode_routes(out["meta_info"]["routed_experts"], num_layers=layers, top_k=top_k)
        assert routes.shape == (len(ids) - 1, layers, top_k)
        expected = forward_routes(model, ids)[:-1]
        got = routes[:, moe_layers].sort(-1).values.long()
        assert torch.equal(got, expected.sort(-1).values), prompt
        dense = [layer for layer in range(layers) if layer not in moe_layers]
        assert not routes[:, dense].any()


def test_the_field_needs_an_engine_started_for_it():
    engine = Engine(family_model("qwen3_moe"), byte_tokenizer(), max_context=64)
    try:
        with pytest.raises(ValueError, match="--enable-return-routed-experts"):
            engine.make_requests({"input_ids": [1, 2], "return_routed_experts": True})
        plain = generate(engine, input_ids=[1, 2], sampling_params={"max_new_tokens": 2})
        assert "routed_experts" not in plain[0]["meta_info"]
    finally:
        engine.scheduler.stop()
    engine = Engine(
        family_model("qwen3_moe"),
        byte_tokenizer(),
        max_context=64,
        enable_return_routed_experts=True,
    )
    try:  # started for routes: every response has them (sglang-router drops the field)
        unasked = generate(engine, input_ids=[1, 2], sampling_params={"max_new_tokens": 2})
        routes = decode_routes(unasked[0]["meta_info"]["routed_experts"], num_layers=2, top_k=2)
        assert routes.shape == (3, 2, 2)
    finally:
        engine.scheduler.stop()
    with pytest.raises(ValueError, match="needs an MoE model"):
        Engine(family_model("qwen3"), byte_tokenizer(), enable_return_routed_experts=True)
