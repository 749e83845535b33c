"""``algorithm.routing_replay`` (rollout routing replay, R3): what it needs, refused
before Ray starts, and the shape of the routes a rollout asks for."""

from rl_launcher.config import TrainConfig

MOE_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


def check_routing_replay(config: TrainConfig) -> None:
    """An MoE policy whose routers both the engines and the backend can replay, routes
    from every rollout request, and no recompute the Megatron pipeline would replay wrong.
    SGLang engines behind sglang-router work: the router drops return_routed_experts, so
    the rollout's client sends those requests to the workers (rl_sglang.router_client)."""
    if not config.algorithm.routing_replay:
        return
    from rl_core.routing import HF_REPLAY_MODEL_TYPES
    from rl_launcher.config.switch_checks import policy_hf_config

    hf_config = policy_hf_config(config)
    model_type = getattr(hf_config, "model_type", None)
    if not any(getattr(hf_config, name, 0) for name in MOE_EXPERT_FIELDS):
        raise ValueError(
            f"algorithm.routing_replay=true replays an MoE model's expert choices, but the "
            f"policy (model_type {model_type!r}) is dense; set algorithm.routing_replay=false"
        )
    hf_routers = config.engine.kind == "embedded" or config.backend.name == "fsdp"
    if hf_routers and model_type not in HF_REPLAY_MODEL_TYPES:
        raise ValueError(
            f"algorithm.routing_replay=true: the embedded engine and the fsdp backend replay "
            f"the Hugging Face routers of {', '.join(HF_REPLAY_MODEL_TYPES)}, not "
            f"{model_type!r}; use engine.kind=sglang with backend.name=megatron, or set "
            "algorithm.routing_replay=false"
        )
    if getattr(config.rollout, "data_plane", None) == "workers":
        raise ValueError(
            "algorithm.routing_replay=true: rollout.data_plane=workers generates without "
            "asking for the experts; use the driver's data plane or set "
            "algorithm.routing_replay=false"
        )
    if config.rollout.source == "buffer":
        raise ValueError(
            "algorithm.routing_replay=true needs the experts of every sample, and "
            "rollout.source=buffer's workers generate without asking for them; use "
            "rollout.source=prompts or set algorithm.routing_replay=false"
        )
    recompute = config.model.gradient_checkpointing or config.backend.megatron.get(
        "recompute_granularity"
    )
    if config.backend.name == "megatron" and config.backend.pipeline_parallel > 1 and recompute:
        raise ValueError(
            "algorithm.routing_replay=true with megatron pipeline parallelism and activation "
            "recompute: a layer recomputed in the backward would replay the routes of a later "
            "micro-batch; set backend.pipeline_parallel=1, or model.gradient_checkpointing=false "
            "and no backend.megatron.recompute_granularity"
        )


def routed_experts_shape(config: TrainConfig) -> tuple[int, int] | None:
    """``(hidden layers, experts per token)`` of the routes rollouts ask for; None when
    ``algorithm.routing_replay`` is off."""
    if not config.algorithm.routing_replay:
        return None
    key = (config.model.path, repr(sorted(config.model.init_config.items())))
    if key not in _SHAPES:
        from rl_launcher.config.switch_checks import policy_hf_config

        hf_config = policy_hf_config(config)
        _SHAPES[key] = (hf_config.num_hidden_layers, hf_config.num_experts_per_tok)
    return _SHAPES[key]


_SHAPES: dict = {}  # routed_experts_shape's HF configs read, by model
