"""Rollout routing replay (R3): the experts an MoE engine chose for each token, carried
to the trainer so its routers use the same ones (slime's ``--use-rollout-routing-replay``).

A sequence of ``n`` tokens has routes ``[n - 1, L, K]``: row t holds, for each of the
model's ``L`` hidden layers, the ``K`` experts token t went to when the engine ran it
(SGLang's ``meta_info["routed_experts"]`` layout; the last token is sampled, never run).
Rows of dense layers carry whatever the engine wrote (SGLang: zeros); nothing reads them.
In a packed batch the routes are ``[N, L, K]``, one row per token; a row of
:data:`NO_ROUTE` (every sequence's last position, or tokens the engine never ran) leaves
that token to the trainer's own router.

Replay keeps the router differentiable: the experts are given, their weights come from
the router's own scores of its logits (softmax, or DeepSeek-V3's sigmoid), so gradients
still reach the router weights (slime gathers the router's scores at the replayed indices
the same way).

Shapes: ``T`` tokens, ``E`` experts, ``K`` experts per token, ``L`` hidden layers.
"""

import array
import base64
import re
from collections.abc import Sequence

import torch

NO_ROUTE = -1  # a route entry the router fills with its own choice
ROUTE_DTYPE = torch.int16  # expert ids < 32768; -1 for NO_ROUTE


def replayed_indices(given_TK: torch.Tensor, own_TK: torch.Tensor) -> torch.Tensor:
    """The experts each token uses ``[T, K]`` long: ``given_TK`` where it names one, the
    router's own top-k ``own_TK`` where it holds :data:`NO_ROUTE`."""
    given = given_TK.to(device=own_TK.device, dtype=torch.long)
    return torch.where(given >= 0, given, own_TK.long())


def replay_topk(
    router_logits_TE: torch.Tensor, given_TK: torch.Tensor, *, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, K] float32, experts [T, K] long)`` of a softmax top-k router (Qwen3-MoE,
    Qwen2-MoE, Mixtral) made to use ``given_TK`` (:func:`replayed_indices`): each weight is
    the softmax over all ``E`` logits at that expert, divided by the sum over the ``K``
    chosen when ``norm_topk_prob``. Differentiable in the logits."""
    probs_TE = torch.softmax(router_logits_TE.float(), dim=-1)
    own_TK = torch.topk(probs_TE.detach(), given_TK.shape[-1], dim=-1).indices
    experts_TK = replayed_indices(given_TK, own_TK)
    weights_TK = probs_TE.gather(-1, experts_TK)
    if norm_topk_prob:
        weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    return weights_TK, experts_TK


def replay_sigmoid_topk(
    router_logits_TE: torch.Tensor,
    given_TK: torch.Tensor,
    own_TK: torch.Tensor,
    *,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, K] float32, experts [T, K] long)`` of DeepSeek-V3's sigmoid router made
    to use ``given_TK`` (the router's own choice ``own_TK`` where it holds :data:`NO_ROUTE`).
    The expert bias (``e_score_correction_bias``) and the group limit only pick experts, so
    the given ones are used as they are; each weight is the sigmoid of its logit, divided by
    the sum over the ``K`` chosen when ``norm_topk_prob``, times ``scaling``
    (``routed_scaling_factor``), as HF weighs the experts it picked. Differentiable in the
    logits."""
    experts_TK = replayed_indices(given_TK, own_TK)
    weights_TK = torch.sigmoid(router_logits_TE.float()).gather(-1, experts_TK)
    if norm_topk_prob:
        weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
    return weights_TK * scaling, experts_TK


def replay_hf_router(
    router: torch.nn.Module, output: tuple, given_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, K], experts [T, K])`` of a Hugging Face router (:func:`hf_moe_routers`)
    whose forward returned ``output`` = ``(logits [T, E], weights, experts)``, made to use
    ``given_TK``: DeepSeek-V3's sigmoid router (it holds ``e_score_correction_bias``) by
    :func:`replay_sigmoid_topk`, softmax routers by :func:`replay_topk`."""
    logits_TE, _, own_TK = output
    if hasattr(router, "e_score_correction_bias"):
        return replay_sigmoid_topk(
            logits_TE,
            given_TK,
            own_TK,
            norm_topk_prob=router.norm_topk_prob,
            scaling=router.routed_scaling_factor,
        )
    norm = getattr(router, "norm_topk_prob", True)  # Mixtral always renormalises
    return replay_topk(logits_TE, given_TK, norm_topk_prob=norm)


def packed_routes(routes: Sequence[torch.Tensor | None], lengths: Sequence[int]) -> torch.Tensor:
    """Per-sequence routes (``[<= n - 1, L, K]`` for a sequence of ``n`` tokens) packed to
    ``[sum n, L, K]`` :data:`ROUTE_DTYPE`; rows a sequence lacks (its last token, a tail the
    engine never ran) are :data:`NO_ROUTE`. A sequence with more rows than tokens - 1 is a
    ValueError (routes of other tokens)."""
    shapes = {tuple(r.shape[1:]) for r in routes if r is not None}
    if len(shapes) != 1:
        raise ValueError(f"routes of one batch need one [layers, top_k] shape, got {shapes}")
    (tail,) = shapes
    out = torch.full((sum(lengths), *tail), NO_ROUTE, dtype=ROUTE_DTYPE)
    start = 0
    for index, (seq_routes, length) in enumerate(zip(routes, lengths, strict=True)):
        rows = 0 if seq_routes is None else seq_routes.shape[0]
        if rows > max(length - 1, 0):
            raise ValueError(f"sequence {index}: {rows} route rows for {length} tokens")
        if rows:
            out[start : start + rows] = seq_routes.to(ROUTE_DTYPE)
        start += length
    return out


def encode_routes(routes: torch.Tensor) -> str:
    """SGLang's wire form of routes ``[n, L, K]``: base64 of their int32 bytes."""
    ids = array.array("i", routes.to(torch.int32).flatten().tolist())
    return base64.b64encode(ids.tobytes()).decode("ascii")


def decode_routes(text: str, *, num_layers: int, top_k: int) -> torch.Tensor:
    """Routes ``[n, num_layers, top_k]`` :data:`ROUTE_DTYPE` from :func:`encode_routes`'s form."""
    raw = bytearray(base64.b64decode(text))
    flat = torch.frombuffer(raw, dtype=torch.int32) if raw else torch.zeros(0, dtype=torch.int32)
    if flat.numel() % (num_layers * top_k):
        raise ValueError(
            f"{flat.numel()} routed expert ids do not split into rows of {num_layers} layers "
            f"x {top_k} experts"
        )
    return flat.view(-1, num_layers, top_k).to(ROUTE_DTYPE)


# Hugging Face MoE families whose routers are top-k modules returning ``(logits [T, E],
# weights [T, K], experts [T, K])`` (class names ending in TopKRouter, or DeepSeek-V3's
# TopkRouter): softmax top-k, or DeepSeek-V3's sigmoid router (replay_hf_router).
HF_REPLAY_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3")


def hf_moe_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The routers of a Hugging Face MoE model by decoder layer index (from the module name
    ``...layers.<i>...``); {} for a dense model."""
    routers = {}
    for name, module in model.named_modules():
        if type(module).__name__.lower().endswith("topkrouter"):
            match = re.search(r"layers\.(\d+)\.", name)
            assert match, f"router {name} is not inside a numbered decoder layer"
            routers[int(match.group(1))] = module
    return routers


def check_replay_model_type(model_type: str) -> None:
    """ValueError unless rollout routing replay knows the family's routers."""
    if model_type not in HF_REPLAY_MODEL_TYPES:
        raise ValueError(
            f"rollout routing replay needs an MoE model with top-k routers it knows "
            f"({', '.join(HF_REPLAY_MODEL_TYPES)}); got model_type {model_type!r}"
        )
