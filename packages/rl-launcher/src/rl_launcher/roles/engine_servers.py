"""What an engine server of a run is: an embedded engine or a real SGLang server, not yet
started (:mod:`rl_launcher.roles.engine_pool` starts them, here or on their nodes).

:func:`engine_process` builds the server: ``gpu_ids`` are the physical GPU ids of the
engine's bundles, handed to it as CUDA_VISIBLE_DEVICES (None on CPU). SGLang servers get their options from the config
(tensor-parallel size, memory fraction, dtype, seed, weight version "0", the memory saver
when colocated, and for an engine over several nodes its ``--nnodes`` / ``--node-rank`` /
``--dist-init-addr``) overridden by ``--sglang-*`` pass-through options, and their PYTHONPATH
from ``RL_SGLANG_PYTHONPATH`` (rl-sglang's SGLangServer keeps SGLang's pinned transformers
out of the trainer's process). Embedded engines get the model's dtype and the run's
context bound (:func:`engine_max_context`).
"""

from pathlib import Path

SGLANG_READY_TIMEOUT_S = 900.0  # the first start compiles Triton kernels (minutes)


def sglang_server_args(config, *, memory_saver: bool, multi_node: dict | None = None) -> dict:
    """``sglang.launch_server`` options (``key -> value``, True for a bare flag).
    ``multi_node``: this server's part of an engine over several nodes (``nnodes``,
    ``node_rank``, ``dist_init_addr``: node rank 0's address and a port free there);
    ``tp_size`` is then the engine's GPUs on all its nodes."""
    from rl_launcher.roles.lora import sglang_lora_args
    from rl_sglang.process import sglang_args_from_cli

    passthrough, rest = sglang_args_from_cli(list(config.engine.sglang_args))
    if rest:
        raise ValueError(
            f"engine.sglang_args holds {rest!r}; every item must be a --sglang-* option "
            "(e.g. --sglang-attention-backend triton)"
        )
    args = {
        "tp_size": config.engine.devices_per_engine,
        "mem_fraction_static": config.engine.mem_fraction,
        "dtype": config.model.dtype,
        "random_seed": config.seed,
        "weight_version": "0",  # as the embedded engine: rollouts before any sync are v0
    }
    if memory_saver:  # /release_memory_occupation needs it
        args["enable_memory_saver"] = True
    if config.algorithm.routing_replay:  # requests ask return_routed_experts
        args["enable_return_routed_experts"] = True
    if config.engine.quantization == "fp8":  # FP8 matmuls by SGLang's triton block kernels
        args |= {"quantization": "fp8", "fp8_gemm_backend": "triton"}
    graph_batch = cuda_graph_batch(config)
    if graph_batch is not None:
        args["cuda_graph_max_bs"] = graph_batch
    return args | dict(multi_node or {}) | sglang_lora_args(config) | passthrough


def cuda_graph_batch(config) -> int | None:
    """SGLang's ``--cuda-graph-max-bs`` for a rollout of more concurrent samples per engine
    than SGLang captures by default: decode batches above the largest captured graph run
    eagerly, launch-bound for a small model (a 0.36B model's colocated rollout of 1,024
    samples took 2.3-2.8 s with the default graphs and 1.3-1.7 s with graphs to 1,024 on an
    H200). The samples of one step per engine, rounded up to a multiple of 16, at most 1,024;
    None (SGLang's default) at 256 or fewer."""
    samples = config.rollout.batch_size * config.rollout.group_size
    per_engine = -(-samples // config.engine.num_engines)
    if per_engine <= 256:
        return None
    return min(1024, -(-per_engine // 16) * 16)


def engine_processes(
    config,
    *,
    model_dir: Path,
    log_dir: Path,
    gpus: list | None,
    max_batch_size: int,
    memory_saver: bool = False,
) -> list:
    """One not-yet-started server per engine (``config.engine.num_engines``), on this
    machine at ``engine.host``."""
    gpus = gpus or [None] * config.engine.num_engines
    return [
        engine_process(
            config,
            model_dir=model_dir,
            log_dir=log_dir,
            gpu_ids=ids,
            host=config.engine.host,
            max_batch_size=max_batch_size,
            memory_saver=memory_saver,
        )
        for ids in gpus
    ]


def engine_process(
    config,
    *,
    model_dir: Path,
    log_dir: Path,
    gpu_ids,
    host: str,
    max_batch_size: int,
    memory_saver: bool = False,
    api_key=None,
    multi_node: dict | None = None,
):
    """One not-yet-started server bound to ``host`` on a port free there; ``api_key``
    None: rl-sglang's default (``RL_SGLANG_API_KEY``); ``multi_node``: see
    :func:`sglang_server_args` (SGLang only)."""
    where = {"host": host, "log_dir": log_dir, "api_key": api_key}
    if config.engine.kind == "sglang":
        from rl_sglang.process import SGLangServer

        args = sglang_server_args(config, memory_saver=memory_saver, multi_node=multi_node)
        return SGLangServer(
            model_dir,
            sglang_args=args,
            gpu_ids=gpu_ids,
            ready_timeout_s=SGLANG_READY_TIMEOUT_S,
            **where,
        )
    assert multi_node is None, "embedded engines run on one node (config/checks.py)"
    from rl_launcher.roles.lora import embedded_lora_args
    from rl_sglang.process import EmbeddedEngine

    device = "cuda" if config.cluster.device == "cuda" else "cpu"
    context = engine_max_context(config)
    extra = [] if context is None else ["--max-context", str(context)]
    if device == "cuda":
        extra += ["--mem-fraction", str(config.engine.mem_fraction)]
    extra += ["--decode-attention", config.engine.decode_attention]
    if config.engine.sampled_multi_step:
        extra.append("--sampled-multi-step")
    extra += embedded_lora_args(config)
    if config.algorithm.routing_replay:
        extra.append("--enable-return-routed-experts")
    return EmbeddedEngine(
        model_dir,
        device=device,
        dtype=config.model.dtype,
        max_batch_size=max_batch_size,
        env=visible_devices(gpu_ids),
        extra_args=extra,
        **where,
    )


def engine_max_context(config) -> int | None:
    """Prompt + response tokens one request may hold in an embedded engine: the run's own
    bound, which sizes the engine's KV slots (a model's limit, 8,192 for SmolLM2, would
    make every decode step attend over that many positions per row). ``engine.max_context``
    when set; else the longest prompt kept plus the longest response limit (rollout or
    eval); None (the model's limit) for a custom rollout function, whose context may grow
    over turns."""
    if config.engine.max_context is not None:
        return config.engine.max_context
    if config.rollout.function != "default":
        return None
    responses = (config.rollout.max_response_tokens, config.eval.max_response_tokens or 0)
    return config.data.max_prompt_tokens + max(responses)


def visible_devices(gpu_ids) -> dict:
    return {} if gpu_ids is None else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpu_ids))}


def engine_gpus(plan, placement) -> list[list[int]] | None:
    """Physical GPU ids of each engine's bundles; None for CPU bundles."""
    if not placement.use_gpu:
        return None
    return [[placement.gpu_ids[b] for b in bundles] for bundles in plan.engine_bundles]
