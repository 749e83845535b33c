"""HF <-> Megatron conversion of whole checkpoints, over the backend's own pieces: the model
builder, the sharded HF loader (:mod:`rl_megatron.weights`), megatron's distributed
checkpointing (:mod:`rl_megatron.checkpoint`) and the HF export (:mod:`rl_megatron.export`).

A converted Megatron checkpoint is a megatron-core distributed checkpoint (``torch_dist``)
of the model's ``sharded_state_dict()`` under the key ``model`` (the same entries as the
backend's training checkpoints, which add optimizer state), plus ``hf/`` (the HF config and
tokenizer files, so that the way back needs nothing else) and ``meta.json`` written last.
Megatron reshards on load, so the way back may use another TP/PP/EP layout with the same
padded vocabulary (``128 · tp`` multiples).

:func:`plan_hf_to_megatron` / :func:`plan_megatron_to_hf` check everything that can be
checked without ranks; :func:`run_rank` is what each rank runs (``rl-convert`` spawns them).
"""

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from rl_core.weights import HF_TOKENIZER_FILES
from rl_megatron import checkpoint
from rl_megatron.shape import model_shape

WEIGHTS_KIND = "megatron_weights"
HF_SUBDIR = "hf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files of an HF directory that are not weights and travel with them.
SIDE_FILES = ("config.json", *HF_TOKENIZER_FILES)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One conversion, checked: ``direction`` "hf-to-megatron" or "megatron-to-hf"."""

    direction: str
    source: str
    output: str
    config_dir: str  # the HF directory holding config.json (and tokenizer files)
    tp: int
    pp: int
    ep: int
    dtype: str  # the parameters' dtype on the ranks (the stored one)
    output_dtype: str  # of the tensors written
    family: str

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.ep  # data parallel = ep: experts split over it


def plan_hf_to_megatron(hf_dir, output, *, tp=1, pp=1, ep=1, dtype="auto", overwrite=False):
    """The checked :class:`Plan` of converting the HF directory ``hf_dir``; ValueError
    naming what to change otherwise."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"{hf_dir} has no config.json; give an HF model directory")
    if not any(hf_dir.glob("*.safetensors")):
        raise ValueError(f"{hf_dir} has no *.safetensors files; save the model with safetensors")
    config = _hf_config(hf_dir)
    _check_output(Path(output), overwrite)
    family = _check_layout(config, tp, pp, ep)
    dtype = _dtype_name(config, dtype)
    return Plan(
        direction="hf-to-megatron",
        source=str(hf_dir),
        output=str(output),
        config_dir=str(hf_dir),
        tp=tp,
        pp=pp,
        ep=ep,
        dtype=dtype,
        output_dtype=dtype,
        family=family,
    )


def plan_megatron_to_hf(
    ckpt, output, *, config_dir=None, tp=None, pp=None, ep=None, dtype="auto", overwrite=False
):
    """The checked :class:`Plan` of converting ``ckpt`` (from ``hf-to-megatron``, or a
    training checkpoint of the backend with ``config_dir`` its HF directory). The layout
    defaults to the saved one."""
    ckpt = Path(ckpt)
    meta = checkpoint.distributed_meta(ckpt, {})
    if meta.get("mode") == "critic":
        raise ValueError(f"{ckpt} is a critic's checkpoint: a value head has no HF form")
    if config_dir is None:
        config_dir = checkpoint.complete_path(ckpt) / HF_SUBDIR
        if not (config_dir / "config.json").is_file():
            raise ValueError(
                f"{ckpt} holds no HF config (a training checkpoint); give --config with the "
                "HF directory the run started from"
            )
    config = _hf_config(Path(config_dir))
    _check_output(Path(output), overwrite)
    saved = meta.get("saved_layout", {})
    tp, pp, ep = (v or saved.get(k, 1) for k, v in (("tp", tp), ("pp", pp), ("ep", ep)))
    family = _check_layout(config, tp, pp, ep)
    saved_vocab = model_shape(config, tp_size=saved.get("tp", 1)).padded_vocab_size
    if model_shape(config, tp_size=tp).padded_vocab_size != saved_vocab:
        raise ValueError(
            f"tp={tp} pads the vocabulary to another size than the saved tp={saved.get('tp')} "
            f"({saved_vocab} rows); convert with --tp {saved.get('tp')}"
        )
    stored = meta.get("dtype", "float32")  # training checkpoints keep fp32 weights
    return Plan(
        direction="megatron-to-hf",
        source=str(ckpt),
        output=str(output),
        config_dir=str(config_dir),
        tp=tp,
        pp=pp,
        ep=ep,
        dtype=stored,
        output_dtype=_dtype_name(config, dtype),
        family=family,
    )


def _hf_config(directory: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(directory))


def _check_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not overwrite:
        raise ValueError(f"{output} exists; choose another output or pass --overwrite")


def _check_layout(config, tp: int, pp: int, ep: int) -> str:
    for name, size in (("tp", tp), ("pp", pp), ("ep", ep)):
        if size < 1:
            raise ValueError(f"--{name} must be >= 1, got {size}")
    shape = model_shape(config, tp_size=tp)  # the family check, tp divides the heads
    if shape.num_layers % pp:
        raise ValueError(f"--pp {pp} must divide the number of layers ({shape.num_layers})")
    if ep > 1 and not shape.num_experts:
        raise ValueError(f"--ep {ep} splits experts, and {shape.family} has none; use --ep 1")
    if shape.num_experts % ep:
        raise ValueError(f"--ep {ep} must divide the number of experts ({shape.num_experts})")
    return shape.family


def _dtype_name(config, requested: str) -> str:
    """``requested``, or with "auto" the checkpoint's own dtype (float32 if it names none)."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"--dtype {requested!r}: choose auto, {', '.join(DTYPES)}")
        return requested
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(saved).removeprefix("torch.") if saved is not None else "float32"
    return name if name in DTYPES else "float32"


def run_rank(rank: int, plan: Plan, port: int) -> None:
    """One rank of ``plan``: join the gloo group on 127.0.0.1:``port``, build this rank's
    model shard, convert, leave the group."""
    quiet_megatron()
    from rl_megatron.parallel import initialize_parallel
    from rl_megatron.testing import cpu_shim

    torch.set_num_threads(max(1, torch.get_num_threads() // plan.world_size))
    cpu_shim.install()  # megatron-core on CPU: conversions need no GPU
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=plan.world_size
    )
    try:
        initialize_parallel(tp=plan.tp, pp=plan.pp, ep=plan.ep, device="cpu")
        if plan.direction == "hf-to-megatron":
            _hf_to_megatron(plan)
        else:
            _megatron_to_hf(plan)
    finally:
        dist.destroy_process_group()


def quiet_megatron() -> None:
    """Silence what importing and checkpointing megatron-core on CPU prints on every rank
    (no Transformer Engine / Apex / CUDA, deprecations inside megatron and torch's
    distributed checkpoint): a conversion's output is its one summary line."""
    import logging
    import warnings

    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings(
            "ignore", category=category, module=r"(megatron|torch\.distributed)"
        )


def _build(plan: Plan):
    from rl_megatron.models import build_gpt_model

    config = _hf_config(Path(plan.config_dir))
    model = build_gpt_model(
        config, tp_size=plan.tp, ep_size=plan.ep, pp_size=plan.pp, dtype=DTYPES[plan.dtype]
    )
    return model, config


def _hf_to_megatron(plan: Plan) -> None:
    from rl_megatron.parallel import current_layout
    from rl_megatron.weights import SafetensorsReader, load_hf_weights

    model, config = _build(plan)
    shape = model_shape(config, tp_size=plan.tp)
    load_hf_weights(model, SafetensorsReader(plan.source), shape, current_layout())
    meta = {
        "kind": WEIGHTS_KIND,
        "mode": "weights",
        "dtype": plan.dtype,
        "saved_layout": {"tp": plan.tp, "pp": plan.pp, "cp": 1, "ep": plan.ep},
    }

    def side_files(tmp: Path) -> None:
        _copy_side_files(Path(plan.source), tmp / HF_SUBDIR)

    checkpoint.save_distributed(
        plan.output, {"model": model.sharded_state_dict()}, meta, extra=side_files
    )


def _megatron_to_hf(plan: Plan) -> None:
    from megatron.core import dist_checkpointing

    from rl_megatron.export import save_hf_directory

    model, config = _build(plan)
    source = checkpoint.complete_path(Path(plan.source))
    _check_matches(model.sharded_state_dict(), source, plan.config_dir)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(source))
    model.load_state_dict(loaded["model"])
    config.dtype = DTYPES[plan.output_dtype]
    save_hf_directory(
        model,
        model_shape(config, tp_size=plan.tp),
        config,
        plan.output,
        dtype=DTYPES[plan.output_dtype],
        extra=lambda tmp: _copy_side_files(Path(plan.config_dir), tmp, skip=("config.json",)),
    )


def _check_matches(sharded: dict, source: Path, config_dir: str) -> None:
    """ValueError naming the first weight that the checkpoint lacks, holds in another global
    shape, or holds beyond the model of ``config_dir`` (a smaller model would load a subset
    silently; megatron's own error lists every key)."""
    saved, wanted = _saved_weights(source), _model_weights(sharded)
    problems = [f"{key} is missing" for key in wanted if key not in saved]
    problems += [
        f"{key} has shape {saved[key]}, not {shape}"
        for key, shape in wanted.items()
        if saved.get(key, shape) != shape
    ]
    problems += [f"{key} is not in that model" for key in saved if key not in wanted]
    if problems:
        raise ValueError(
            f"{source} does not hold the model of {config_dir}: {problems[0]}; give --config "
            "the HF directory the checkpoint was made from"
        )


def _saved_weights(source: Path) -> dict[str, tuple[int, ...]]:
    """``{key: global shape}`` of the model weights in a checkpoint: megatron's torch_dist
    format is torch's distributed checkpoint, whose metadata lists them (optimizer state
    under "optimizer.", extra state as bytes)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(source)).read_metadata().state_dict_metadata
    return {
        key: tuple(meta.size)
        for key, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata) and not key.startswith("optimizer.")
    }


def _model_weights(sharded: dict) -> dict[str, tuple[int, ...]]:
    """``{key: global shape}`` of the whole model, from this rank's sharded state dict and
    every other rank's (a pipeline stage holds only its part); factories built: the gated
    MLP's fc1 is saved as its gate and up halves."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded)
    mine = {
        entry.key: tuple(entry.global_shape)
        for entry in nested_values(sharded)
        if isinstance(entry, ShardedTensor)
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {key: shape for part in every for key, shape in part.items()}


def _copy_side_files(source: Path, target: Path, skip: tuple[str, ...] = ()) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name in SIDE_FILES:
        if name not in skip and (source / name).is_file():
            shutil.copy2(source / name, target / name)


def describe(plan: Plan) -> str:
    """One line naming the conversion (for the command's summary)."""
    fields = asdict(plan)
    return json.dumps({k: fields[k] for k in ("family", "tp", "pp", "ep", "output_dtype")})
