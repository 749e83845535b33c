"""torch.compile of each decoder layer as one graph (or, without the attention modules,
of its MLP and RMSNorms alone): the memory-bound parts fused, and no Python between them.

In eager Hugging Face code these are chains of elementwise kernels (RMSNorm upcasts to
float32 and makes ~7 passes over ``[N, hidden]``; SwiGLU reads and writes ``[N, inter]``
three times; rotary makes ~6 passes over the queries and keys), forward and backward: at
8192 tokens on the 1.5B shape, ~6 GB of memory traffic per layer. Compiled, each becomes
one or two fused kernels.

With the attention modules (``attention=True``) the unit is the whole decoder layer:
norms, projections, rotary, the packed attention kernel and the MLP in one graph, forward
and backward, for the implementations traced whole (``torch_varlen``, ``sdpa_mask``:
:data:`rl_fsdp.attention.TRACED_IMPLS`). The others run eager behind one graph break in
the middle of the layer (their host-side layouts and per-sequence loops are not traced).
Layers with mixture-of-experts blocks (data-dependent routing) keep the per-module units:
MLP, RMSNorms and the attention module around its eager kernel (a graph break). Flex
attention (compiled per length bucket on its own; with dynamic shapes it failed) is
called with ``attention=False``: MLPs and RMSNorms only.

Every instance of a class shares one compiled graph (dynamo guards on the module
structure, not its identity), and the token dimension (dim 1 of ``[1, N]`` and
``[1, N, D]``, and the packed layout's boundaries and mask) is dynamic from the first call:
one graph serves every micro-batch length (hidden sizes, the reduction dimensions, stay
static). Inductor's heuristics could put guards on that size at the first micro-batch's
length, so the first micro-batch on the other side of a threshold, steps later, recompiled
each layer's forward and backward (7.8 s at step 5 of a colocated H100 run, 2026-11-27):
- on CUDA the one such guard was Triton's mix-order reduction in the RMSNorm backward
  (``N * hidden >= 5 * 2**20``); it is asked not to check sizes (:data:`NON_STRICT_MIX_ORDER`:
  it fuses at every length, as it did above its threshold), and the token dimension stays
  *backed*, so inductor sizes its kernels from a real length. Unbacked, the norm and
  elementwise kernels took 1.6x as long (71 against 44 ms in a loop step of the 0.5B shape
  on an H200, 2026-11-27) for the same absence of recompiles;
- on the CPU the C++ backend's float-sum helper guards ``N > 4096`` and has no such switch,
  so there the token dimension is *unbacked* (``mark_unbacked``: no guard can be placed on
  it; :data:`UNBACKED_TOKENS`).
The longest sequence, a host int the varlen kernel takes, is dynamic from the first
compile too (:data:`DYNAMIC_INTS`; static, it recompiled at its first new value); torch's
kernel choice still branches on it (whether it is ``<= 128``).

A module whose compiled forward raises falls back to its eager forward for good (a whole
layer to its blocks compiled one by one, as without ``attention``, attention module
included); the error is kept in :data:`COMPILE_FAILURES` (the bench reports it).
"""

import functools
import warnings

import torch
from torch import nn

from rl_core import compiling

COMPILE_FAILURES = compiling.COMPILE_FAILURES  # the classes fallen back (the bench reports it)
COMPILED_SUFFIXES = ("MLP", "RMSNorm")
ATTENTION_SUFFIX = "Attention"
PER_MODULE_ONLY = ("moe", "expert")  # class-name parts of layers kept per module


class CompiledOrEager(compiling.CompiledOrEager):
    """:class:`rl_core.compiling.CompiledOrEager` for HF blocks ``[1, N, ...]``: the token
    dimension of every tensor argument dynamic; a failure warned. A whole layer's
    ``fallback`` compiles its blocks one by one."""

    def __init__(self, module, *, backend, dynamic=None, **kwargs):
        super().__init__(module, backend=backend, dynamic=dynamic, **kwargs)
        if options := inductor_options(backend):
            self.compiled = torch.compile(
                self.eager, backend=backend, dynamic=dynamic, options=options
            )

    def mark_dynamic(self, args: tuple, kwargs: dict) -> None:
        _mark_tokens_dynamic(args, kwargs)

    def report_failure(self, error: Exception) -> None:
        message = f"torch.compile of {self.name} failed, running eager: {error!r}"
        warnings.warn(message, stacklevel=3)


# Whether the token dimension is unbacked: None, on the CPU only (the module docstring);
# True or False everywhere (bench/train_fsdp.py --unbacked-tokens / --backed-tokens, for A/Bs)
UNBACKED_TOKENS: bool | None = None
# False: Triton's mix-order reduction checks sizes, guarding on the token count
# (bench/train_fsdp.py --strict-mix-order, for A/Bs)
NON_STRICT_MIX_ORDER = True


def _mark_tokens_dynamic(args: tuple, kwargs: dict) -> None:
    """Dim 1 (the tokens) of every ``[1, N]`` or ``[1, N, D]`` tensor argument, also inside
    tuples (rotary ``(cos, sin)``), and the packed layout's token dimensions are dynamic
    from the first call, unbacked on the CPU (the module docstring). 4-D arguments (Hugging
    Face's empty mask ``[1, 1, 0, 0]``) have no token dimension. The sequence count (the
    boundaries' length) is dynamic, backed: a kernel standing in for the varlen one may
    read the boundaries back (``tolist``)."""
    for value in (*args, *kwargs.values()):
        for tensor in value if isinstance(value, tuple) else (value,):
            if isinstance(tensor, torch.Tensor) and tensor.dim() in (2, 3):
                _mark_tokens(tensor, 1)
    layout = kwargs.get("rl_layout")
    if layout is not None:
        for tensor, dim in layout.token_dims():
            _mark_tokens(tensor, dim)
        for tensor, dim in layout.dynamic_dims():
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _mark_tokens(tensor: torch.Tensor, dim: int) -> None:
    unbacked = UNBACKED_TOKENS if UNBACKED_TOKENS is not None else tensor.device.type == "cpu"
    if unbacked:
        torch._dynamo.decorators.mark_unbacked(tensor, dim)
    else:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)


# Host ints that vary between micro-batches, dynamic from the first compile: entries of
# torch.compiler.config.dynamic_sources, by exact name (as the compiled frames see them:
# a decoder layer's and an attention module's forward take the layout in ``**kwargs``)
DYNAMIC_INTS = ("L['kwargs']['rl_layout'].max_seqlen",)
# Inductor options of the compiled layers: Triton's mix-order reduction (the RMSNorm
# backward) without its size checks, which guarded on the token count
INDUCTOR_OPTIONS = {"triton.mix_order_reduction_non_strict_mode": True}


def mark_ints_dynamic(sources=DYNAMIC_INTS) -> None:
    """Add ``sources`` to torch's dynamic sources (idempotent; others' entries kept). A
    torch without the option keeps its automatic dynamic ints (one recompile at the
    first new value)."""
    config = torch.compiler.config
    if not hasattr(config, "dynamic_sources"):
        return
    entries = [e for e in config.dynamic_sources.split(",") if e]
    config.dynamic_sources = ",".join(entries + [s for s in sources if s not in entries])


def inductor_options(backend) -> dict | None:
    """:data:`INDUCTOR_OPTIONS` this torch has, for the inductor backend (None otherwise)."""
    if backend != "inductor" or not NON_STRICT_MIX_ORDER:
        return None
    from torch._inductor import config

    options = {k: v for k, v in INDUCTOR_OPTIONS.items() if _has_option(config, k)}
    return options or None


def _has_option(config, dotted: str) -> bool:
    *parents, name = dotted.split(".")
    for part in parents:
        config = getattr(config, part, None)
    return config is not None and hasattr(config, name)


def fusible_modules(model: nn.Module, *, attention: bool = True) -> list[nn.Module]:
    """The MLPs and RMSNorms of ``model`` (by class name: Qwen2MLP, LlamaRMSNorm, ...)
    and, with ``attention``, its attention modules (Qwen2Attention, ...)."""
    suffixes = COMPILED_SUFFIXES + ((ATTENTION_SUFFIX,) if attention else ())
    return [m for m in model.modules() if type(m).__name__.endswith(suffixes)]


def compile_blocks(
    model: nn.Module,
    *,
    attention: bool = True,
    backend: str = "inductor",
    dynamic: bool | None = None,
) -> int:
    """Compile ``model``'s blocks in place (parameter names unchanged): with ``attention``
    each decoder layer whole (see the module docstring) and the RMSNorms outside them;
    without it, or for layers of :data:`PER_MODULE_ONLY` kinds, every MLP and RMSNorm.
    Returns how many modules were wrapped. Idempotent."""
    compiling.raise_recompile_limit()
    mark_ints_dynamic()
    failed_classes = set()
    wrap = functools.partial(_wrap, backend=backend, dynamic=dynamic, failed=failed_classes)
    layers, count = {id(layer) for layer in decoder_layers(model)}, 0
    for module in compile_units(model, attention=attention):
        blocks = fusible_modules(module) if id(module) in layers else []  # a whole layer's
        count += wrap([module], fallback=functools.partial(wrap, blocks) if blocks else None)
    return count


def _wrap(modules, *, backend, dynamic, failed: set, fallback=None) -> int:
    """Wrap the ``forward`` of each of ``modules`` not wrapped yet; how many were."""
    count = 0
    for module in modules:
        if not isinstance(module.__dict__.get("forward"), CompiledOrEager):
            module.forward = CompiledOrEager(
                module, backend=backend, failed_classes=failed, dynamic=dynamic, fallback=fallback
            )
            count += 1
    return count


def compile_units(model: nn.Module, *, attention: bool) -> list[nn.Module]:
    """The modules :func:`compile_blocks` wraps: whole decoder layers (with ``attention``,
    where allowed) and the MLPs, RMSNorms (and with ``attention`` the attention modules,
    around an eager kernel) outside them."""
    whole = [layer for layer in decoder_layers(model) if attention and _whole(layer)]
    inside = {id(m) for layer in whole for m in layer.modules()}
    rest = fusible_modules(model, attention=attention)
    return whole + [m for m in rest if id(m) not in inside]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (one FSDP unit each), found by the model's no-split classes."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to shard")
    return layers


def _whole(layer: nn.Module) -> bool:
    names = (type(m).__name__.lower() for m in layer.modules())
    return not any(part in name for name in names for part in PER_MODULE_ONLY)


def compiled_count(model: nn.Module) -> tuple[int, int]:
    """``(compiled, fell back to eager)`` counts of the wrapped modules of ``model``."""
    wrappers = compiling.wrapped_forwards(model.modules())
    failed = sum(w.failed for w in wrappers)
    return len(wrappers) - failed, failed


def compiled_classes(model: nn.Module) -> list[str]:
    """Class names of the modules of ``model`` running compiled (not fallen back)."""
    return sorted({w.name for w in compiling.wrapped_forwards(model.modules()) if not w.failed})
