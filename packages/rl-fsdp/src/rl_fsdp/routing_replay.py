"""Rollout routing replay (R3) in a Hugging Face MoE model: its routers send each token to
the experts the engine chose during rollout (``TrainBatch.routed_experts``).

A forward hook on every router (:func:`rl_core.routing.hf_moe_routers`) replaces its top-k
with the given experts and their weights with the router's own scores at those experts
(:func:`rl_core.routing.replay_hf_router`: softmax top-k routers, DeepSeek-V3's sigmoid
router with its scaling), so the loss's gradient still reaches the router weights. The
routes stay set until the next forward sets others: an activation-checkpointed layer
recomputed in the backward replays the same routes as its forward did.

The backend replays in the old-log-prob pass and the training pass; the KL reference
routes on its own (it is another model; slime's reference pass does the same).

Shapes: ``N`` packed tokens of the forward, ``L`` hidden layers, ``K`` experts per token.
"""

import torch

from rl_core.routing import hf_moe_routers, replay_hf_router


class RouteReplay:
    """Hooks on ``model``'s routers; :meth:`use` sets the routes of the next forwards."""

    def __init__(self, model: torch.nn.Module):
        self.routers = hf_moe_routers(model)
        self.routes_NLK: torch.Tensor | None = None
        self.num_replayed = 0  # router calls that replayed (tests check replay happened)
        for layer, router in self.routers.items():
            router.register_forward_hook(self._replayer(layer))

    def use(self, routes_NLK: torch.Tensor | None) -> None:
        """Replay ``routes_NLK`` in the next forwards (and their recomputes); None: every
        router chooses on its own."""
        if routes_NLK is not None and not self.routers:
            raise ValueError("the batch carries routed_experts but the model has no MoE router")
        self.routes_NLK = routes_NLK

    def _replayer(self, layer: int):
        def replay(router, args, output):
            if self.routes_NLK is None:
                return None
            logits_NE, weights_NK, _ = output
            given_NK = self.routes_NLK[:, layer]
            if given_NK.shape[0] != logits_NE.shape[0]:
                raise ValueError(
                    f"layer {layer}: routes for {given_NK.shape[0]} tokens, the router got "
                    f"{logits_NE.shape[0]}"
                )
            weights, experts = replay_hf_router(router, output, given_NK)
            self.num_replayed += 1
            return logits_NE, weights.to(weights_NK.dtype), experts

        return replay
