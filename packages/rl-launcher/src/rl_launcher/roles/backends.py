"""The training backends a rank can run: rl-fsdp's ``FSDPBackend`` or rl-megatron's
``MegatronBackend``, both :class:`rl_core.protocols.TrainingBackend`; the launcher calls
nothing else on them.

    spec = backend_spec(config, model_dir=path, num_ranks=4)  # on the driver, validated
    backend = build_backend(spec, rank=r, world_size=4, master_addr=..., master_port=...)

The loss is described once: :func:`objective_of` builds the run's
:class:`rl_core.objective.Objective` from the config, and both backend configs carry that
same object. Each Objective field is read from ``algorithm.<same name>`` unless
:data:`OBJECTIVE_SOURCES` says where else it lives, so a new loss option is one field of
the Objective and one option of the same name in ``algorithm``.

``spec.data_parallel`` is the number of distinct batches a step is split into: every rank
for FSDP; ``num_ranks / (tp x pp x cp)`` for Megatron, whose TP / PP / CP ranks of one
data-parallel rank share a batch. ``--megatron-KEY [VALUE]`` options set any
:class:`rl_megatron.config.MegatronConfig` field but the objective
(``--megatron-sequence-parallel``, ``--megatron-logprob-chunk-size 2048``).
"""

import dataclasses
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rl_core.objective import Objective
from rl_core.protocols import TrainingBackend

PRECISIONS = {"float32": "fp32", "bfloat16": "bf16"}
MEGATRON_PREFIX = "--megatron-"
# backend.name -> (module, class) implementing rl_core.protocols.TrainingBackend
BACKENDS = {
    "fsdp": ("rl_fsdp", "FSDPBackend"),
    "megatron": ("rl_megatron.backend", "MegatronBackend"),
}

# MegatronConfig field -> the rl-train option that sets it (backend.megatron refuses the
# megatron-core fields behind these, naming the option: rl_megatron.options.OWNED)
MEGATRON_OWNERS = {
    "tp": "backend.tensor_parallel",
    "pp": "backend.pipeline_parallel",
    "cp": "backend.context_parallel",
    "ep": "backend.expert_parallel",
    "precision": "model.dtype",
    "hf_path": "model.path",
    "lr": "optimizer.lr",
    "min_lr_ratio": "optimizer.min_lr_ratio",
    "weight_decay": "optimizer.weight_decay",
    "adam_betas": "optimizer.betas",
    "adam_eps": "optimizer.eps",
    "clip_grad": "optimizer.grad_clip",
    "sequence_parallel": "backend.extra_args --megatron-sequence-parallel",
    "swiglu_fusion": "backend.extra_args --megatron-swiglu-fusion",
}

# model.gradient_checkpointing on Megatron: each layer's input kept, the layer recomputed
FULL_RECOMPUTE = {
    "recompute_granularity": "full",
    "recompute_method": "uniform",
    "recompute_num_layers": 1,
}

# The Objective fields the config holds elsewhere than algorithm.<same name>.
OBJECTIVE_SOURCES = {
    "mode": lambda config: {"sft": "sft", "dpo": "dpo"}.get(config.mode, "policy"),
    # seq-mean-token-sum-norm's constant: the response limit (Dr.GRPO's generation budget;
    # verl's default, the padded width, is that limit when responses are padded to it)
    "norm_length": lambda config: float(config.rollout.max_response_tokens),
    "temperature": lambda config: config.rollout.temperature or 1.0,  # 0 (greedy) samples at 1
    "old_from_rollout": lambda config: config.algorithm.old_log_probs == "rollout",
}


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    name: str  # "fsdp" | "megatron"
    config: Any  # FSDPConfig | MegatronConfig, each carrying the run's Objective
    device: str  # "cpu" | "cuda"
    data_parallel: int


def objective_of(config) -> Objective:
    """The run's Objective: every field from ``algorithm.<name>`` or :data:`OBJECTIVE_SOURCES`."""
    fields = {}
    for field in dataclasses.fields(Objective):
        if field.name in OBJECTIVE_SOURCES:
            fields[field.name] = OBJECTIVE_SOURCES[field.name](config)
        elif hasattr(config.algorithm, field.name):
            fields[field.name] = getattr(config.algorithm, field.name)
        else:
            raise ValueError(
                f"Objective.{field.name} has no source: add algorithm.{field.name} to the "
                "config schema or an entry to OBJECTIVE_SOURCES"
            )
    return Objective(**fields)


def backend_spec(config, *, model_dir: Path, num_ranks: int) -> BackendSpec:
    """The backend config of a :class:`~rl_launcher.config.TrainConfig` for ``num_ranks``."""
    device, objective = config.cluster.device, objective_of(config)
    if config.backend.name == "megatron":
        megatron = megatron_config(config, model_dir=model_dir, objective=objective)
        model_parallel = megatron.tp * megatron.pp * megatron.cp
        return BackendSpec(
            name="megatron",
            config=megatron,
            device=device,
            data_parallel=num_ranks // model_parallel,
        )
    fsdp = fsdp_config(config, model_dir=model_dir, objective=objective)
    return BackendSpec(name="fsdp", config=fsdp, device=device, data_parallel=num_ranks)


def _precision(config, backend: str) -> str:
    if config.model.dtype not in PRECISIONS:
        raise ValueError(
            f"model.dtype={config.model.dtype!r}: the {backend} backend takes float32 or bfloat16"
        )
    return PRECISIONS[config.model.dtype]


def updates_per_step(config) -> int:
    """Optimizer updates in one rl-train step (``algorithm.num_minibatches``). The backends'
    schedules count updates, the config counts rl-train steps: warm-up and decay length are
    multiplied by this so the decay ends at ``num_steps`` whatever the minibatch count."""
    return config.algorithm.num_minibatches


def fsdp_config(config, *, model_dir: Path, objective: Objective | None = None):
    """The rl-fsdp config of a :class:`~rl_launcher.config.TrainConfig` (``objective``:
    the run's, None = :func:`objective_of` the config)."""
    from rl_fsdp import FSDPConfig
    from rl_launcher.roles.lora import lora_spec

    opt = config.optimizer
    precision = _precision(config, "fsdp")
    return FSDPConfig(
        model_path=str(model_dir),
        seed=config.seed,
        device=config.cluster.device,
        precision=precision,
        attention="auto",
        export_dtype=precision,  # engines serve model.dtype: bf16 runs send bf16, not fp32 masters
        activation_checkpointing=config.model.gradient_checkpointing,
        max_tokens_per_micro_batch=config.backend.micro_batch_tokens,
        objective=objective or objective_of(config),
        optimizer=opt.name,
        momentum=opt.momentum,
        lr=opt.lr,
        weight_decay=opt.weight_decay,
        betas=tuple(opt.betas),
        eps=opt.eps,
        warmup_steps=opt.warmup_steps * updates_per_step(config),
        lr_decay=opt.schedule,
        total_steps=config.num_steps * updates_per_step(config),
        min_lr_ratio=opt.min_lr_ratio,
        max_grad_norm=opt.grad_clip or None,
        lora=lora_spec(config),
        ref_path=config.algorithm.ref_path,
        value_clip=config.algorithm.value_clip,  # the critic's (rl_launcher.roles.critic)
        train_only=tuple(config.model.train_only),
        freeze=tuple(config.model.freeze),
    )


def megatron_config(config, *, model_dir: Path, objective: Objective | None = None):
    """The rl-megatron config: parallel layout from ``backend.*``, then ``--megatron-*``
    (``objective`` as in :func:`fsdp_config`; the reference, when it needs one, is the
    starting model)."""
    from rl_megatron.config import MegatronConfig

    opt, backend = config.optimizer, config.backend
    if opt.name != "adamw":
        raise ValueError("backend.name=megatron trains with AdamW: set optimizer.name=adamw")
    fields = dict(
        hf_path=model_dir,
        objective=objective or objective_of(config),
        tp=backend.tensor_parallel,
        pp=backend.pipeline_parallel,
        cp=backend.context_parallel,
        ep=backend.expert_parallel,
        device=config.cluster.device,
        precision=_precision(config, "megatron"),
        seed=config.seed,
        lr=opt.lr,
        warmup_steps=opt.warmup_steps * updates_per_step(config),
        lr_decay=opt.schedule,
        total_steps=config.num_steps * updates_per_step(config),
        min_lr_ratio=opt.min_lr_ratio,
        weight_decay=opt.weight_decay,
        adam_betas=tuple(opt.betas),
        adam_eps=opt.eps,
        clip_grad=opt.grad_clip,
        max_tokens_per_micro_batch=backend.micro_batch_tokens,
        train_only=tuple(config.model.train_only),
        freeze=tuple(config.model.freeze),
        megatron=megatron_options(config),
    )
    if config.algorithm.ref_path is not None:  # else the starting model, when one is needed
        fields["ref_path"] = Path(config.algorithm.ref_path)
    return MegatronConfig(**(fields | megatron_overrides(backend.extra_args)))


def megatron_options(config) -> dict[str, Any]:
    """``backend.megatron``, checked against megatron-core's dataclasses
    (:func:`rl_megatron.options.split_options`; ValueError naming the rl-train option
    that sets a field this mapping may not). ``model.gradient_checkpointing`` is full
    recompute of every layer unless ``backend.megatron`` says how to recompute."""
    from rl_megatron.options import split_options

    options = dict(config.backend.megatron)
    if config.model.gradient_checkpointing and "recompute_granularity" not in options:
        options |= FULL_RECOMPUTE
    split_options(options, where="backend.megatron", owners=MEGATRON_OWNERS)
    return options


def megatron_overrides(extra_args: list[str]) -> dict[str, Any]:
    """``["--megatron-tp", "2", "--megatron-sequence-parallel"]`` -> ``{"tp": 2,
    "sequence_parallel": True}``; values parsed as YAML, unknown keys refused (the
    objective comes from ``algorithm.*``, not from here)."""
    from rl_megatron.config import MegatronConfig

    known = {f.name for f in dataclasses.fields(MegatronConfig)} - {"objective"}
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


def backend_class(name: str) -> type:
    """The TrainingBackend class of ``backend.name`` (imported only when used)."""
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def build_backend(
    spec: BackendSpec, *, rank: int, world_size: int, master_addr: str, master_port: int
) -> TrainingBackend:
    """Join the ranks' process group (gloo on CPU, nccl on GPU) and build the backend,
    through the protocol's ``start``."""
    return backend_class(spec.name).start(
        spec.config,
        rank=rank,
        world_size=world_size,
        master_addr=master_addr,
        master_port=master_port,
    )
