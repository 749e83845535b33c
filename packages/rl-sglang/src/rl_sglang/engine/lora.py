"""LoRA adapters served per request, as SGLang's ``--enable-lora`` server does.

    lora = LoRAManager(model, max_rank=64, targets=("q_proj", "v_proj"))  # hooks the Linears
    lora.load(read_peft_adapter("policy_v3", "/sync/lora/policy_v3", device, dtype))
    lora.use([lora.resolve("policy_v3"), None])  # the next forward's rows: adapter, base
    lora.unload("policy_v3")

Tests and benchmarks make adapters with :func:`random_adapter` and write them with
:func:`save_peft_adapter`.

An adapter is a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``,
tensors named ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``lora_B.weight``
``[out, r]``). Each targeted ``nn.Linear`` of the base model gets a forward hook that adds,
for the rows of the batch whose request names an adapter with weights for that module,
``scaling * x @ A^T @ B^T`` (``scaling = lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA);
rows without one keep the base output. The rows of one adapter are gathered, adapted with
two matmuls and added back (one group, no gather, when every row shares it), so a batch
may mix any number of adapters and the base.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
ALL_TARGETS = "all"


@dataclass(eq=False)
class Adapter:
    """One loaded adapter: ``weights[module] = (A [r, in], B [out, r])``."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_peft_adapter(name: str, path: str, device, dtype: torch.dtype) -> Adapter:
    """The adapter of PEFT directory ``path``; ValueError naming what does not fit."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / file).is_file():
            raise ValueError(f"lora_path {path!r} has no {file} (a PEFT adapter directory)")
    config = json.loads((folder / CONFIG_FILE).read_text())
    rank, alpha = _rank_and_alpha(config, path)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(folder / WEIGHTS_FILE)
    except SafetensorError as error:  # a damaged or truncated file
        raise ValueError(f"{path}: cannot read {WEIGHTS_FILE}: {error}") from error
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, part = _module_and_part(key, path)
        pairs.setdefault(module, {})[part] = tensor.to(device=device, dtype=dtype)
    weights = {}
    for module, parts in pairs.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise ValueError(f"{path}: module {module} has {sorted(parts)}, needs lora_A and B")
        a, b = parts["lora_A"], parts["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"{path}: {module} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                f"have rank r={rank} (A [r, in], B [out, r])"
            )
        weights[module] = (a, b)
    if not weights:
        raise ValueError(f"{path}: {WEIGHTS_FILE} holds no lora_A / lora_B tensors")
    return Adapter(name=name, path=str(path), rank=rank, scaling=scaling, weights=weights)


def random_adapter(
    model: nn.Module, *, rank: int, targets, seed: int, scale: float
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``module -> (A [r, in], B [out, r])`` of normal entries times ``scale`` for every
    ``nn.Linear`` of ``model`` whose last name component is in ``targets`` (B non-zero,
    unlike a fresh LoRA's, so it changes the outputs): adapters for tests and benchmarks."""
    generator = torch.Generator().manual_seed(seed)
    adapter = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            a = torch.randn(rank, module.in_features, generator=generator) * scale
            b = torch.randn(module.out_features, rank, generator=generator) * scale
            adapter[name] = (a, b)
    return adapter


def save_peft_adapter(path, adapter, *, rank: int, alpha: float) -> str:
    """``adapter`` (``module -> (A, B)``) as a PEFT LoRA directory at ``path``, what
    rl-fsdp writes for the engines; returns the path."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True)
    targets = sorted({module.rsplit(".", 1)[-1] for module in adapter})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets}
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    tensors = {}
    for module, (a, b) in adapter.items():
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(folder / WEIGHTS_FILE))
    return str(folder)


def _rank_and_alpha(config: dict, path: str) -> tuple[int, float]:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config['peft_type']!r} is not LORA")
    unsupported = [
        key for key in ("rank_pattern", "alpha_pattern", "modules_to_save") if config.get(key)
    ]
    unsupported += ["use_dora"] if config.get("use_dora") else []
    unsupported += ["bias"] if config.get("bias", "none") != "none" else []
    if unsupported:
        raise ValueError(f"{path}: adapter_config sets {unsupported}, which this engine lacks")
    rank = int(config.get("r", 0))
    if rank < 1:
        raise ValueError(f"{path}: adapter_config needs a rank r >= 1, got {config.get('r')}")
    return rank, float(config.get("lora_alpha", rank))


def _module_and_part(key: str, path: str) -> tuple[str, str]:
    """``base_model.model.X.lora_A.weight`` -> ``("X", "lora_A")``."""
    stem = key.removeprefix(PEFT_PREFIX).removesuffix(".weight")
    module, _, part = stem.rpartition(".")
    if part not in ("lora_A", "lora_B") or not key.endswith(".weight"):
        raise ValueError(f"{path}: tensor {key!r} is not a PEFT LoRA weight (X.lora_A.weight)")
    return module, part


class LoRAManager:
    """The adapters an engine holds and the hooks that apply them (see the module
    docstring). ``targets``: last name components of the Linears that may be adapted, or
    ``("all",)`` for every Linear but ``lm_head``; ``max_rank``: None for no limit."""

    def __init__(self, model: nn.Module, *, max_rank: int | None, targets=(ALL_TARGETS,)):
        if max_rank is not None and max_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_rank}")
        self.max_rank, self.targets = max_rank, tuple(targets)
        self.adapters: dict[str, Adapter] = {}
        self.modules = {
            name: module for name, module in model.named_modules() if self._targeted(name, module)
        }
        if not self.modules:
            raise ValueError(f"lora target modules {list(targets)} match no nn.Linear")
        for name, module in self.modules.items():
            module.register_forward_hook(self._hook(name))
        self._rows: tuple = ()
        self._groups: list[tuple[Adapter, torch.Tensor | None]] = []

    def _targeted(self, name: str, module: nn.Module) -> bool:
        if not isinstance(module, nn.Linear) or name.endswith("lm_head"):
            return False
        return ALL_TARGETS in self.targets or name.rsplit(".", 1)[-1] in self.targets

    # ---- the registry ---------------------------------------------------------------
    def load(self, adapter: Adapter) -> None:
        if adapter.name in self.adapters:
            raise ValueError(
                f"lora_name {adapter.name!r} is loaded already; unload it first or use a new name"
            )
        if self.max_rank is not None and adapter.rank > self.max_rank:
            raise ValueError(f"adapter rank {adapter.rank} exceeds --max-lora-rank {self.max_rank}")
        for module, (a, b) in adapter.weights.items():
            linear = self.modules.get(module)
            if linear is None:
                raise ValueError(
                    f"adapter module {module!r} is not a LoRA target of this engine "
                    f"(--lora-target-modules {' '.join(self.targets)})"
                )
            if a.shape[1] != linear.in_features or b.shape[0] != linear.out_features:
                raise ValueError(
                    f"adapter {module}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a "
                    f"Linear {linear.in_features} -> {linear.out_features}"
                )
        self.adapters[adapter.name] = adapter

    def unload(self, name: str) -> None:
        """Forget ``name``; requests already admitted with it keep their adapter."""
        if name not in self.adapters:
            raise ValueError(f"lora_name {name!r} is not loaded (loaded: {sorted(self.adapters)})")
        del self.adapters[name]

    def loaded(self) -> dict[str, str]:
        """``{name: path}``, as SGLang's ``loaded_adapters``."""
        return {name: adapter.path for name, adapter in self.adapters.items()}

    def resolve(self, name: str | None) -> Adapter | None:
        if name is None:
            return None
        if name not in self.adapters:
            raise ValueError(
                f"lora_path {name!r} is not loaded; POST /load_lora_adapter first "
                f"(loaded: {sorted(self.adapters)})"
            )
        return self.adapters[name]

    # ---- the forward ----------------------------------------------------------------
    def use(self, rows: list[Adapter | None]) -> None:
        """The adapter (None: the base) of each batch row of the forwards that follow."""
        key = tuple(rows)
        if key == self._rows:
            return
        self._rows, self._groups = key, []
        for adapter in dict.fromkeys(a for a in rows if a is not None):
            index = [row for row, a in enumerate(rows) if a is adapter]
            whole = len(index) == len(rows)
            self._groups.append((adapter, None if whole else torch.tensor(index)))

    def _hook(self, module_name: str):
        def hook(module: nn.Linear, inputs, output_BTO):
            for adapter, rows in self._groups:
                if module_name not in adapter.weights:
                    continue
                a, b = adapter.weights[module_name]
                if rows is None:
                    output_BTO = output_BTO + _delta(inputs[0], a, b, adapter.scaling, output_BTO)
                    continue
                rows = rows.to(output_BTO.device)
                delta = _delta(inputs[0].index_select(0, rows), a, b, adapter.scaling, output_BTO)
                output_BTO = output_BTO.index_add(0, rows, delta)
            return output_BTO

        return hook


def _delta(x_BTI, a_RI, b_OR, scaling: float, like: torch.Tensor) -> torch.Tensor:
    """``scaling * x @ A^T @ B^T`` in the adapter's dtype, cast to ``like``'s (as the
    trainer's adapted Linear computes it)."""
    return (x_BTI.to(a_RI.dtype) @ a_RI.t() @ b_OR.t()).to(like.dtype) * scaling
