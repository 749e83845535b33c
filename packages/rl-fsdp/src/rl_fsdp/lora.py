"""LoRA adapters on a Hugging Face model, kept under the model's own parameter names.

    wrapped = add_lora(model, LoRASpec(rank=8, alpha=16))  # ["model.layers.0.self_attn.q_proj", ...]
    optimizer = torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=1e-4)
    torch.save(lora_state_dict(model), "adapter.pt")            # adapters only
    for name, tensor in merge_lora(model.named_parameters(), scaling=spec.scaling): ...

Each targeted ``nn.Linear`` keeps its ``weight`` (frozen) and gains two parameters,
``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``, plus a forward hook adding
``scaling * dropout(x) @ A.T @ B.T`` to its output (``scaling = alpha / r``; B starts at
zero, so the model starts exactly as the base). Why our own module rather than peft: peft
rewrites module paths (``base_model.model...``, ``base_layer``), so every weight name the
engines, checkpoints and exports know would change; here the base names stay, FSDP2 shards
the two extra parameters with their module, and the merge for an engine is one matmul per
target (:func:`merge_lora`).
"""

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch import nn

LORA_A, LORA_B = "lora_A", "lora_B"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRASpec:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS  # last component of the Linear's name

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ValueError("lora targets must name at least one Linear (e.g. q_proj)")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        """JSON-ready fields (what an adapter checkpoint records to rebuild the model)."""
        return {**asdict(self), "targets": list(self.targets)}


def add_lora(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Freeze every parameter of ``model`` and add adapters to the targeted Linears.
    Returns the adapted module names; refuses a spec that matches none."""
    for param in model.parameters():
        param.requires_grad_(False)
    wrapped = [name for name, mod in model.named_modules() if _targeted(name, mod, spec)]
    if not wrapped:
        found = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        )
        raise ValueError(
            f"lora targets {list(spec.targets)} match no nn.Linear; this model's are {found}"
        )
    modules = dict(model.named_modules())
    for name in wrapped:
        _attach(modules[name], spec)
    return wrapped


def _targeted(name: str, module: nn.Module, spec: LoRASpec) -> bool:
    return isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in spec.targets


def _attach(linear: nn.Linear, spec: LoRASpec) -> None:
    weight = linear.weight
    a = torch.empty(spec.rank, linear.in_features, dtype=weight.dtype, device=weight.device)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # nn.Linear's own init, as LoRA's paper
    b = torch.zeros(linear.out_features, spec.rank, dtype=weight.dtype, device=weight.device)
    linear.register_parameter(LORA_A, nn.Parameter(a))
    linear.register_parameter(LORA_B, nn.Parameter(b))
    dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
    linear.add_module("lora_dropout", dropout)
    linear.lora_enabled = True
    linear.register_forward_hook(_adapter_hook(spec.scaling))


def _adapter_hook(scaling: float):
    def hook(module: nn.Linear, inputs, output):
        if not module.lora_enabled:
            return output
        x = module.lora_dropout(inputs[0])
        a, b = _local(getattr(module, LORA_A)), _local(getattr(module, LORA_B))
        return output + (x.to(a.dtype) @ a.t() @ b.t()).to(output.dtype) * scaling

    return hook


def _local(param: torch.Tensor) -> torch.Tensor:
    """A parameter as a plain tensor: FSDP2 gathers it for the forward, so inside the hook
    a DTensor is already whole on this rank (its local view is what matmul needs)."""
    return param.to_local() if hasattr(param, "to_local") else param


@contextmanager
def lora_disabled(model: nn.Module):
    """Within: the adapted Linears compute the base alone (the frozen base model is the
    reference policy of a LoRA run, so no second copy of it is needed)."""
    adapted = [m for m in model.modules() if hasattr(m, "lora_enabled")]
    for module in adapted:
        module.lora_enabled = False
    try:
        yield
    finally:
        for module in adapted:
            module.lora_enabled = True


def is_lora_name(name: str) -> bool:
    return name.endswith(("." + LORA_A, "." + LORA_B))


def lora_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The adapter parameters, the only ones an optimizer should hold."""
    return ((n, p) for n, p in model.named_parameters() if is_lora_name(n))


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapters (what a LoRA checkpoint saves besides the base model's path)."""
    return {n: t for n, t in model.state_dict().items() if is_lora_name(n)}


def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load adapters saved by :func:`lora_state_dict`; a missing or extra name is refused."""
    expected = set(lora_state_dict(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(
            f"LoRA state does not fit the model: missing {missing[:3]}, "
            f"unexpected {extra[:3]} (different targets or rank?)"
        )
    model.load_state_dict(state, strict=False)


def merge_lora(
    named: Iterable[tuple[str, torch.Tensor]], *, scaling: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` pairs in ``named_parameters`` order with each adapted
    ``X.weight`` replaced by ``W + scaling * B @ A`` and the adapters dropped: what an
    engine that serves merged weights loads. A module's weight is held back until its two
    adapters (registered after it, and after its bias) have passed, or until another
    module's tensor shows that it has none."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        prefix, _, leaf = name.rpartition(".")
        yield from _release(held, keep=prefix)
        if leaf == "weight":
            held[prefix] = {"weight": tensor}
        elif leaf in (LORA_A, LORA_B):
            parts = held.get(prefix)
            if parts is None:
                raise ValueError(f"merge_lora: {name} came without its module's weight")
            parts[leaf] = tensor
            if LORA_A in parts and LORA_B in parts:
                yield f"{prefix}.weight", _merged(held.pop(prefix), scaling)
        else:
            yield name, tensor
    yield from _release(held, keep=None)


def _release(held: dict[str, dict[str, torch.Tensor]], *, keep: str | None):
    """Weights held back that have no adapter after all (another module's tensor came);
    ``keep``'s own entry waits."""
    for prefix in [p for p, parts in held.items() if p != keep and len(parts) == 1]:
        yield f"{prefix}.weight", held.pop(prefix)["weight"]


def _merged(parts: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
    weight, a, b = parts["weight"], parts[LORA_A], parts[LORA_B]
    delta = (b.float() @ a.float()) * scaling
    return (weight.float() + delta).to(weight.dtype)
