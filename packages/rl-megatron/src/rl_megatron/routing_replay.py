"""Rollout routing replay (R3) in Megatron's MoE routers: each token goes to the experts
the engine chose during rollout (``TrainBatch.routed_experts``), through the router's own
replay seam (``TopKRouter.router_replay.get_replay_topk``, which megatron-core calls with
the router's scores and its top-k function).

The replayed weights are the router's scores gathered at the given experts, as
megatron-core's own replay and slime's do: with ``moe_router_pre_softmax`` (Qwen3-MoE with
``norm_topk_prob`` False) the softmax over all experts, else the logits, softmaxed over the
``K`` chosen afterwards (renormalised top-k). DeepSeek-V3's sigmoid router uses its
expert bias (``e_score_correction_bias``) and group limit only to pick experts, so under
replay neither applies: its weights are the sigmoid scores at the given experts, divided
by their sum and scaled by ``routed_scaling_factor``, as HF computes them for the experts
it picked. The given experts are used as they are, even where they break the group limit.
Gradients reach the router weights.

Which routes: the backend queues each micro-batch's routes, right-padded ``[B, T, L, K]``,
in the order its forwards run (:meth:`RouteReplay.feed`; the pipeline schedules run
forwards in micro-batch order, and with virtual stages each model chunk runs them in that
order: every chunk gets its own queue). A forward pre-hook on each chunk takes the next
one and lays it out as the router sees its tokens: padded to the forward's ``[B', T']``
rows (EP's common shape, rounded widths), this CP rank's zigzag part, sequence-major
``[T'·B', L, K]``, and under sequence parallel this TP rank's part of the sequence.
Padding routes on its own (:data:`rl_core.routing.NO_ROUTE`), as does every micro-batch of
a batch without routes (and the empty micro-batches virtual stages add).

A layer recomputed in the backward (activation recompute) replays the routes of the last
forward: right with pp = 1, where each micro-batch's backward follows its forward; with
pp > 1 the launcher refuses recompute with replay.

Shapes: ``L`` hidden layers, ``K`` experts per token, ``E`` experts.
"""

import contextlib
import functools
from collections import deque

import torch

from rl_core.cp import zigzag_slice
from rl_core.packing import pad_packed
from rl_core.routing import NO_ROUTE, replayed_indices


class RouteReplay:
    """Installed on the routers of ``models`` (a pipeline stage's model chunks, one without
    virtual stages); ``enabled`` False (the KL reference, a critic) leaves every router to
    its own choice."""

    def __init__(self, models, *, cp_size=1, cp_rank=0, tp_size=1, tp_rank=0, enabled=True):
        from megatron.core.transformer.moe.router import TopKRouter

        models = list(models)
        self.cp_size, self.cp_rank, self.tp_size, self.tp_rank = cp_size, cp_rank, tp_size, tp_rank
        self.sequence_parallel = bool(getattr(models[0].config, "sequence_parallel", False))
        self.enabled = enabled
        self.queues: list[deque] = [deque() for _ in models]  # per chunk: its forwards' routes
        self.current: torch.Tensor | None = None  # [tokens of the router, L, K]
        self.num_replayed = 0  # router calls that replayed (tests check replay happened)
        for index, model in enumerate(models):
            for module in model.modules():
                if isinstance(module, TopKRouter):  # layer_number: global, from 1
                    module.router_replay = _LayerReplay(self, module.layer_number - 1)
            hook = functools.partial(self._next_forward, index)
            model.register_forward_pre_hook(hook, with_kwargs=True)

    def feed(self, batch, groups: list[list[int]]) -> None:
        """The routes of ``batch``'s micro-batches ``groups`` (sequence indices), in the order
        their forwards run; replaces what an earlier pass left."""
        routes = batch.routed_experts
        padded = [
            None if routes is None or not group else _padded(batch.select(group))
            for group in groups
        ]
        self.queues = [deque(padded) for _ in self.queues]

    @contextlib.contextmanager
    def off(self):
        """Every router chooses on its own meanwhile (the reference's passes)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def _next_forward(self, index: int, model, args, kwargs) -> None:
        input_ids = args[0] if args else kwargs["input_ids"]
        queue = self.queues[index]
        padded = queue.popleft() if queue else None
        self.current = None if padded is None else self._router_layout(padded, input_ids.shape)

    def _router_layout(self, padded_BTLK: torch.Tensor, shape) -> torch.Tensor:
        """``[B, T, L, K]`` -> the router's ``[T'·B' (/tp), L, K]`` for inputs ``[B', T']``."""
        rows, width = shape
        full = torch.full(
            (rows, width * self.cp_size, *padded_BTLK.shape[2:]),
            NO_ROUTE,
            dtype=padded_BTLK.dtype,
            device=padded_BTLK.device,
        )
        full[: padded_BTLK.shape[0], : padded_BTLK.shape[1]] = padded_BTLK
        if self.cp_size > 1:
            full = zigzag_slice(full, cp_size=self.cp_size, cp_rank=self.cp_rank, dim=1)
        routes = full.transpose(0, 1).reshape(-1, *full.shape[2:])  # sequence-major
        if self.sequence_parallel and self.tp_size > 1:
            routes = routes.chunk(self.tp_size)[self.tp_rank]
        return routes


def _padded(part) -> torch.Tensor:
    """A micro-batch's routes right-padded per sequence: ``[B, T_max, L, K]``."""
    return pad_packed(part.routed_experts, part.cu_seqlens, pad_value=NO_ROUTE)[0]


class _LayerReplay:
    """One router's replay seam (megatron-core's ``RouterReplay.get_replay_topk`` call)."""

    def __init__(self, owner: RouteReplay, layer: int):
        self.owner, self.layer = owner, layer

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, compute_topk=None):
        """``(scores at the experts [T, K], experts [T, K])``: the replayed ones where the
        current routes name them, the router's own top-k elsewhere."""
        values, own = compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        routes = self.owner.current
        if routes is None or not self.owner.enabled:
            return values, own
        given = routes[:, self.layer]
        if given.shape[0] != scores.shape[0]:
            raise ValueError(
                f"layer {self.layer}: routes for {given.shape[0]} tokens, the router got "
                f"{scores.shape[0]}"
            )
        experts = replayed_indices(given, own)
        self.owner.num_replayed += 1
        return scores.gather(1, experts), experts
