"""The experts an MoE model's routers chose for each token the engine ran: SGLang's
``return_routed_experts`` (``--enable-return-routed-experts``), for rollout routing replay.

Forward hooks on the Hugging Face routers (:func:`rl_core.routing.hf_moe_routers`) keep
each forward's ``[B·T, K]`` expert ids while a row of it asked for them; the scheduler then
hands each request its rows. A request's routes cover every token that went through the
model, prompt first: ``[len(prompt) + len(output) - 1, L, K]`` (the last sampled token is
never run), as SGLang returns them in ``meta_info["routed_experts"]`` (base64 int32). Layers
without a router (dense MLPs) hold 0, as SGLang's buffer does.

Shapes: ``B`` rows of a forward, ``T`` its positions (left-padded prefill, or 1 to decode),
``L`` hidden layers, ``K`` experts per token.
"""

import torch

from rl_core.routing import ROUTE_DTYPE, hf_moe_routers


class RouteRecorder:
    """Keeps the routers' choices of the forwards it is armed for; ``model=None``: records
    nothing (an engine started without ``--enable-return-routed-experts``)."""

    def __init__(self, model: torch.nn.Module | None = None):
        self.routers = hf_moe_routers(model) if model is not None else {}
        if model is not None and not self.routers:
            raise ValueError(
                "--enable-return-routed-experts needs an MoE model (no Hugging Face "
                "TopKRouter module found)"
            )
        self.num_layers = model.config.num_hidden_layers if self.routers else 0
        self.top_k = model.config.num_experts_per_tok if self.routers else 0
        self.armed = False
        self._experts: dict[int, torch.Tensor] = {}  # layer -> [B·T, K] of the last forward
        for layer, router in self.routers.items():
            router.register_forward_hook(self._keeper(layer))

    @property
    def enabled(self) -> bool:
        return bool(self.routers)

    def _keeper(self, layer: int):
        def keep(module, args, output):
            if self.armed:
                self._experts[layer] = output[2]

        return keep

    def arm(self, requests) -> None:
        """Record the next forward when one of its rows (``requests``) asked for routes."""
        self.armed = self.enabled and any(r.return_routed_experts for r in requests)
        self._experts = {}

    def after_prefill(self, requests, prompts: list[list[int]]) -> None:
        """Each asking request's routes become those of its (left-padded) prefill row."""
        if not self.armed:
            return
        routes_BTLK = self._take(len(requests))
        width = routes_BTLK.shape[1]
        for row, (request, prompt) in enumerate(zip(requests, prompts, strict=True)):
            if request.return_routed_experts:
                request.routes = [routes_BTLK[row, width - len(prompt) :]]

    def after_decode(self, requests) -> None:
        """Each asking request gains the routes of the token it just fed."""
        if not self.armed:
            return
        routes_BTLK = self._take(len(requests))
        for row, request in enumerate(requests):
            if request.return_routed_experts:
                request.routes.append(routes_BTLK[row])

    def _take(self, rows: int) -> torch.Tensor:
        """``[B, T, L, K]`` on the host of the recorded forward (0 for layers without a
        router), and disarm."""
        assert self._experts, "an armed forward recorded no routes"
        some = next(iter(self._experts.values()))
        out = torch.zeros(some.shape[0], self.num_layers, self.top_k, dtype=ROUTE_DTYPE)
        for layer, experts in self._experts.items():
            out[:, layer] = experts.to("cpu", ROUTE_DTYPE)
        self.armed, self._experts = False, {}
        return out.view(rows, -1, self.num_layers, self.top_k)
