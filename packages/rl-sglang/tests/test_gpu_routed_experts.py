"""GPU only: rollout routing replay (R3) from real SGLang behind the real sglang-router.

A tiny Qwen3-MoE (3 layers, 8 experts, top-2; random weights) is served by SGLang started
with ``--enable-return-routed-experts``; rl-sglang's rollout functions ask for routed
experts through :class:`~rl_sglang.router_client.RouterClient` (the router drops the
field; the client sends those requests to its worker). Every sample gets ``[seqlen - 1,
layers, top_k]`` expert ids below ``num_experts``, distinct per token and layer, mostly
the experts a float32 HF forward picks on its own; replayed in that forward
(rl-fsdp's RouteReplay), SGLang's log-probs are matched closer than with the forward's own
routes, and much closer than with routes one token off. Run on the GPU machine:
RL_SGLANG_PYTHONPATH=/tmp/sgsite pytest -m gpu packages/rl-sglang/tests/test_gpu_routed_experts.py
"""

import asyncio

import pytest
import torch
from test_gpu_sglang import PROMPT, SGLANG_ARGS

from rl_core.routing import hf_moe_routers, packed_routes
from rl_core.types import Sample
from rl_sglang.process import SGLangServer
from rl_sglang.rollout.generate import GenerateContext, generate_group, generate_sample
from rl_sglang.router import Router
from rl_sglang.router_client import RouterClient
from rl_sglang.tiny import byte_tokenizer, random_model

pytestmark = pytest.mark.gpu
LAYERS, TOP_K, EXPERTS = 3, 2, 8
MOE_SHAPE = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    norm_topk_prob=True,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
PARAMS = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 1.0}
# mean |SGLang - float32 HF| log-prob of the sampled tokens. The same arithmetic on CPU (a
# bf16 HF model sampling, its routes replayed in the float32 one; 48 tokens, 2026-11-27):
# replayed 0.017 (max 0.066), own routes 0.053 (max 0.90: flipped experts), routes one
# token off 1.11; (token, layer) expert sets equal to float32's own 94-100 %.
REPLAYED_GAP = 0.05
REPLAYED_MAX = 0.5
DEVICE = "cuda"  # of the float32 HF forward


def moe_model(seed: int = 0):
    """Random weights of std 0.1 (rl_sglang.tiny's 0.2 halved): routers decisive enough
    that bf16 rarely flips an expert, experts different enough that a wrong one shows."""
    from transformers import Qwen3MoeConfig

    model = random_model(Qwen3MoeConfig(**MOE_SHAPE), seed=seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(0.5)
    return model


@pytest.fixture(scope="module")
def moe_router(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    moe_model().save_pretrained(root / "model")
    byte_tokenizer().save_pretrained(root / "model")
    # a KV cache of 32k tokens: SGLang's host buffer of routes has a row for each
    args = SGLANG_ARGS | {"enable_return_routed_experts": True, "max_total_tokens": 32768}
    with SGLangServer(
        root / "model", sglang_args=args, log_dir=root, ready_timeout_s=600
    ) as server:
        router = Router([server.url], log_dir=root).start()
        try:
            yield router
        finally:
            router.stop()


def rollout(url: str) -> list[Sample]:
    """Three single requests and one n=3 group, every one asking for routed experts."""
    singles = [Sample(tokens=list(p), index=i) for i, p in enumerate([PROMPT, [7] * 9, [1, 2]])]
    group = [Sample(tokens=[33, 44, 55], index=3 + i) for i in range(3)]

    async def go():
        async with RouterClient(url) as client:
            ctx = GenerateContext(client=client, routed_experts_shape=(LAYERS, TOP_K))
            await asyncio.gather(
                *(generate_sample(ctx, s, PARAMS) for s in singles),
                generate_group(ctx, group, PARAMS, rid="moe-group"),
            )

    asyncio.run(go())
    return singles + group


def forward(model, replay, sample: Sample, routes):
    """``(log-probs of the response tokens, the experts each router used [n, L, K])`` of
    one float32 forward over the sample, replaying ``routes`` ([n, L, K]; None: its own)."""
    used = {}
    hooks = [  # registered after RouteReplay's: they see the replayed experts
        router.register_forward_hook(lambda m, a, out, i=i: used.__setitem__(i, out[2]))
        for i, router in hf_moe_routers(model).items()
    ]
    replay.use(None if routes is None else routes.to(DEVICE))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([sample.tokens], device=DEVICE)).logits[0].float()
    finally:
        replay.use(None)
        for hook in hooks:
            hook.remove()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = sample.prompt_length - 1
    response = torch.tensor(sample.tokens[sample.prompt_length :], device=DEVICE)
    picked = logprobs[start : start + len(response)].gather(-1, response[:, None])[:, 0]
    return picked.cpu(), torch.stack([used[i] for i in sorted(used)], dim=1).cpu()


def test_sglang_routes_through_the_router_replay_in_an_hf_forward(moe_router):
    replay_module = pytest.importorskip("rl_fsdp.routing_replay")
    samples = rollout(moe_router.url)
    model = moe_model().to(DEVICE).eval()
    if hasattr(model, "set_experts_implementation"):  # a plain loop over the experts in
        model.set_experts_implementation("eager")  # float32, not a grouped GEMM
    replay = replay_module.RouteReplay(model)
    gaps = {"replayed": [], "own": [], "one_off": []}
    agree = []
    for sample in samples:
        routes = sample.routed_experts
        assert sample.response_length == PARAMS["max_new_tokens"]
        assert routes.shape == (len(sample.tokens) - 1, LAYERS, TOP_K), routes.shape
        assert int(routes.min()) >= 0 and int(routes.max()) < EXPERTS
        assert (routes.sort(-1).values.diff(dim=-1) > 0).all()  # top-k: distinct experts
        packed = packed_routes([routes], [len(sample.tokens)])  # last row: its own choice
        one_off = torch.cat([packed[1:], packed[:1]])  # each token given the next one's
        engine = torch.tensor(sample.rollout_log_probs)
        for name, given in (("replayed", packed), ("own", None), ("one_off", one_off)):
            logprobs, used = forward(model, replay, sample, given)
            gaps[name].append((logprobs - engine).abs())
            if name == "own":
                same = used[:-1].sort(-1).values == routes.long().sort(-1).values
                agree.append(same.all(-1).float().mean())
            if name == "replayed":
                assert torch.equal(used[:-1], routes.long())  # replay used SGLang's experts
    mean = {name: float(torch.cat(g).mean()) for name, g in gaps.items()}
    replayed_max = float(torch.cat(gaps["replayed"]).max())
    print(f"log-prob gap SGLang vs float32 HF: {mean}, replayed max {replayed_max:.4f}")
    assert float(torch.stack(agree).mean()) > 0.9, agree  # the rows are the tokens' own
    assert mean["replayed"] < REPLAYED_GAP and replayed_max < REPLAYED_MAX, mean
    assert mean["replayed"] <= mean["own"] + 1e-3, mean
    assert mean["one_off"] > max(0.3, 5 * mean["replayed"]), mean  # the test can tell
