"""The training backends a rank can run: rl-fsdp's ``FSDPBackend`` or rl-megatron's
``MegatronBackend`` (same protocol: log-probs, train step, export, checkpoints, offload).

    spec = backend_spec(config, model_dir=path, num_ranks=4)  # on the driver, validated
    backend = build_backend(spec, rank=r, world_size=4, master_addr=..., master_port=...)

``spec.data_parallel`` is the number of distinct batches a step is split into: every rank
for FSDP; ``num_ranks / (tp x pp x cp)`` for Megatron, whose TP / PP / CP ranks of one
data-parallel rank share a batch. ``--megatron-KEY [VALUE]`` options set any
:class:`rl_megatron.config.MegatronConfig` field (``--megatron-sequence-parallel``,
``--megatron-logprob-chunk-size 2048``).
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rl_core.objective import Objective
from rl_launcher.roles.reference import needs_reference

PRECISIONS = {"float32": "fp32", "bfloat16": "bf16"}
MEGATRON_PREFIX = "--megatron-"


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    name: str  # "fsdp" | "megatron"
    config: Any  # FSDPConfig | MegatronConfig
    device: str  # "cpu" | "cuda"
    data_parallel: int


def backend_spec(config, *, model_dir: Path, num_ranks: int) -> BackendSpec:
    """The backend config of a :class:`~rl_launcher.config.TrainConfig` for ``num_ranks``."""
    device = config.cluster.device
    if config.backend.name == "megatron":
        megatron = megatron_config(config, model_dir=model_dir)
        model_parallel = megatron.tp * megatron.pp * megatron.cp
        return BackendSpec(name="megatron", config=megatron, device=device,
                           data_parallel=num_ranks // model_parallel)  # fmt: skip
    return BackendSpec(name="fsdp", config=fsdp_config(config, model_dir=model_dir),
                       device=device, data_parallel=num_ranks)  # fmt: skip


def _precision(config, backend: str) -> str:
    if config.model.dtype not in PRECISIONS:
        raise ValueError(
            f"model.dtype={config.model.dtype!r}: the {backend} backend takes float32 or bfloat16"
        )
    return PRECISIONS[config.model.dtype]


def fsdp_config(config, *, model_dir: Path):
    """The rl-fsdp config of a :class:`~rl_launcher.config.TrainConfig`."""
    from rl_fsdp import FSDPConfig
    from rl_launcher.roles.lora import lora_spec

    algo, opt = config.algorithm, config.optimizer
    precision = _precision(config, "fsdp")
    return FSDPConfig(
        model_path=str(model_dir), seed=config.seed, device=config.cluster.device,
        precision=precision, attention="auto",
        export_dtype=precision,  # engines serve model.dtype: bf16 runs send bf16, not fp32 masters
        activation_checkpointing=config.model.gradient_checkpointing,
        max_tokens_per_micro_batch=config.backend.micro_batch_tokens,
        objective=objective_of(config), reference=needs_reference(algo),
        lr=opt.lr, weight_decay=opt.weight_decay, betas=tuple(opt.betas), eps=opt.eps,
        warmup_steps=opt.warmup_steps, lr_decay=opt.schedule, total_steps=config.num_steps,
        min_lr_ratio=opt.min_lr_ratio, max_grad_norm=opt.grad_clip or None,
        lora=lora_spec(config),
    )  # fmt: skip


def megatron_config(config, *, model_dir: Path):
    """The rl-megatron config: parallel layout from ``backend.*``, then ``--megatron-*``."""
    from rl_megatron.config import MegatronConfig

    algo, opt, backend = config.algorithm, config.optimizer, config.backend
    if opt.schedule != "constant" or opt.warmup_steps or opt.name != "adamw":
        raise ValueError(
            "backend.name=megatron trains with AdamW at a constant learning rate: set "
            "optimizer.name=adamw, optimizer.schedule=constant and optimizer.warmup_steps=0"
        )
    fields = dict(
        hf_path=model_dir, ref_path=model_dir if needs_reference(algo) else None,
        tp=backend.tensor_parallel, pp=backend.pipeline_parallel, cp=backend.context_parallel,
        ep=backend.expert_parallel, device=config.cluster.device,
        precision=_precision(config, "megatron"), seed=config.seed, lr=opt.lr,
        weight_decay=opt.weight_decay, adam_betas=tuple(opt.betas), adam_eps=opt.eps,
        clip_grad=opt.grad_clip, max_tokens_per_micro_batch=backend.micro_batch_tokens,
        objective=objective_of(config),
    )  # fmt: skip
    return MegatronConfig(**(fields | megatron_overrides(backend.extra_args)))


def objective_of(config) -> Objective:
    """The run's :class:`~rl_core.objective.Objective`: every field of the same name in
    ``algorithm.*``, plus the few taken from elsewhere in the config."""
    algo = config.algorithm
    same_name = {f.name: getattr(algo, f.name) for f in dataclasses.fields(Objective)
                 if hasattr(algo, f.name)}  # fmt: skip
    return Objective(**same_name | {
        "mode": _mode(config),
        "norm_length": norm_length(config),
        "temperature": config.rollout.temperature or 1.0,
        "rollout_is_level": algo.rollout_is_level or None,
    })  # fmt: skip


def norm_length(config) -> float:
    """The constant ``seq-mean-token-sum-norm`` divides each step's summed token losses by:
    the response limit (Dr.GRPO's generation budget; verl's default, the padded width, is
    that limit when responses are padded to it)."""
    return float(config.rollout.max_response_tokens)


def _mode(config) -> str:
    return {"sft": "sft", "dpo": "dpo"}.get(config.mode, "policy")


def megatron_overrides(extra_args: list[str]) -> dict[str, Any]:
    """``["--megatron-tp", "2", "--megatron-sequence-parallel"]`` -> ``{"tp": 2,
    "sequence_parallel": True}``; values parsed as YAML, unknown keys refused."""
    from rl_megatron.config import MegatronConfig

    known = {f.name for f in dataclasses.fields(MegatronConfig)}
    overrides, i = {}, 0
    while i < len(extra_args):
        flag = extra_args[i]
        if not flag.startswith(MEGATRON_PREFIX):
            raise ValueError(f"backend.extra_args: {flag!r} is not a --megatron-* option")
        key, _, inline = flag.removeprefix(MEGATRON_PREFIX).partition("=")
        key = key.replace("-", "_")
        if key not in known:
            raise ValueError(
                f"--megatron-{key.replace('_', '-')} is not a MegatronConfig field; "
                f"known: {', '.join(sorted(known))}"
            )
        has_value = (
            not inline and i + 1 < len(extra_args) and not extra_args[i + 1].startswith("--")
        )
        raw = inline or (extra_args[i + 1] if has_value else "true")
        overrides[key] = yaml.safe_load(raw)
        i += 2 if has_value else 1
    return overrides


def build_backend(spec: BackendSpec, *, rank: int, world_size: int, master_addr: str,
                  master_port: int):  # fmt: skip
    """Join the ranks' process group (gloo on CPU, nccl on GPU) and build the backend."""
    from rl_core.distributed import init_distributed

    info = init_distributed(device=spec.device, rank=rank, world_size=world_size,
                            master_addr=master_addr, master_port=master_port)  # fmt: skip
    if spec.name == "fsdp":
        from rl_fsdp import FSDPBackend

        return FSDPBackend(spec.config, dist_info=info)
    if spec.device == "cpu":  # megatron-core allocates on "cuda" unless shimmed
        from rl_megatron.testing import cpu_shim

        cpu_shim.install(spec.config.seed)
    from rl_megatron.backend import MegatronBackend

    return MegatronBackend(spec.config)


def data_rank(spec: BackendSpec, backend, rank: int) -> int:
    """Which of the step's ``spec.data_parallel`` batches this rank trains on."""
    return backend.layout.dp_rank if spec.name == "megatron" else rank


# Megatron names two train metrics differently from rl-fsdp; the loop reads rl-fsdp's.
METRIC_NAMES = {"grad_norm": "train/grad_norm", "lr": "train/lr"}


def common_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {METRIC_NAMES.get(key, key): value for key, value in metrics.items()}
