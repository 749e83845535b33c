"""Rollout routing replay behind the real sglang-router (0.3.2), with two stand-in SGLang
servers (sglang_standin.py) that answer routed experts in SGLang 0.5.15's format.

- The router drops ``return_routed_experts`` and ``routed_experts_start_len`` from the
  /generate body it forwards (keeping ``rid``, ``n``, ``sampling_seed``), and passes the
  engine's ``meta_info["routed_experts"]`` back whole.
- :class:`~rl_sglang.router_client.RouterClient` sends the requests that ask for routes to
  the router's healthy workers (both take some), decoded into each sample's
  ``routed_experts`` ``[seqlen - 1, L, K]`` int16, single and n-requests alike; other
  requests still go through the router; a worker the router took out gets none.
"""

import asyncio

import pytest
import torch
from sglang_standin import SGLangStandIn, standin_routes

from rl_core.routing import ROUTE_DTYPE, decode_routes
from rl_core.types import Sample
from rl_sglang.client import EngineClient
from rl_sglang.rollout.generate import GenerateContext, generate_group, generate_sample
from rl_sglang.router import Router
from rl_sglang.router_client import RouterClient

pytestmark = pytest.mark.integration
LAYERS, TOP_K, EXPERTS = 3, 2, 8
PARAMS = {"max_new_tokens": 5, "temperature": 1.0}


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """Two stand-in engines behind the real router."""
    engines = [SGLangStandIn(num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS) for _ in "ab"]
    log_dir = tmp_path_factory.mktemp("router-logs")
    router = Router([e.url for e in engines], log_dir=log_dir, ready_timeout_s=60).start()
    try:
        yield engines, router
    finally:
        router.stop()
        for engine in engines:
            engine.close()


def expected_routes(sample: Sample) -> torch.Tensor:
    """What the stand-in ran, as the sample should hold it: every token but the last."""
    routes = standin_routes(sample.tokens[:-1], LAYERS, TOP_K, EXPERTS)
    return torch.from_numpy(routes).to(ROUTE_DTYPE)


def test_the_router_drops_the_request_field_and_passes_the_answer_back(routed):
    engines, router = routed
    for engine in engines:
        engine.seen.clear()
        engine.routes_always = True  # answer with routes though the field is gone

    async def ask():
        async with EngineClient(router.url) as client:
            return await client.generate(
                input_ids=[5, 6, 7],
                rid="plain-1",
                sampling_params={**PARAMS, "sampling_seed": 3},
                return_logprob=True,
                return_routed_experts=True,
                routed_experts_start_len=1,
            )

    try:
        out = asyncio.run(ask())
    finally:
        for engine in engines:
            engine.routes_always = False
    (body,) = [b for e in engines for b in e.seen]
    assert "return_routed_experts" not in body and "routed_experts_start_len" not in body
    assert body["rid"] == "plain-1" and body["sampling_params"]["sampling_seed"] == 3
    routes = decode_routes(out["meta_info"]["routed_experts"], num_layers=LAYERS, top_k=TOP_K)
    tokens = [5, 6, 7, *out["output_ids"]]
    assert routes.tolist() == standin_routes(tokens[:-1], LAYERS, TOP_K, EXPERTS).tolist()


def test_router_client_gets_every_samples_routes_from_the_workers(routed):
    engines, router = routed
    for engine in engines:
        engine.seen.clear()
    singles = [Sample(tokens=[10 + i, 20, 30 + i], index=i) for i in range(6)]
    group = [Sample(tokens=[40, 41], index=6 + i) for i in range(3)]

    async def rollout():
        async with RouterClient(router.url) as client:
            ctx = GenerateContext(client=client, routed_experts_shape=(LAYERS, TOP_K))
            await asyncio.gather(
                *(generate_sample(ctx, s, PARAMS) for s in singles),
                generate_group(ctx, group, PARAMS, rid="g"),
            )
            plain = GenerateContext(client=client)  # no routes asked: through the router
            return await generate_sample(plain, Sample(tokens=[9, 9]), PARAMS)

    unrouted = asyncio.run(rollout())
    for sample in [*singles, *group]:
        assert sample.routed_experts.dtype == ROUTE_DTYPE
        assert sample.routed_experts.shape == (len(sample.tokens) - 1, LAYERS, TOP_K)
        assert torch.equal(sample.routed_experts, expected_routes(sample))
    assert len({tuple(s.tokens) for s in group}) == 3  # the n-request's three outputs
    assert unrouted.routed_experts is None
    bodies = [b for e in engines for b in e.seen]
    asked = [b for b in bodies if b.get("return_routed_experts")]
    assert len(asked) == 7 and all(e.seen for e in engines)  # both workers took some
    assert all("log_metrics" not in b for b in asked)  # sent to the worker, not the router
    (through_router,) = [b for b in bodies if not b.get("return_routed_experts")]
    assert "log_metrics" in through_router  # the router re-serialised it


def test_a_worker_the_router_took_out_gets_no_routed_request(routed):
    engines, router = routed
    out_engine, kept = engines
    router.remove_worker(out_engine.url)
    try:
        for engine in engines:
            engine.seen.clear()

        async def ask():
            async with RouterClient(router.url, workers_ttl_s=0.0) as client:
                body = {"input_ids": [1, 2], "sampling_params": PARAMS}
                calls = [client.generate(**body, return_routed_experts=True) for _ in range(4)]
                return await asyncio.gather(*calls)

        outs = asyncio.run(ask())
        assert all("routed_experts" in out["meta_info"] for out in outs)
        assert not out_engine.seen and len(kept.seen) == 4
    finally:
        router.add_worker(out_engine.url)
