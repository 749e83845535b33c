"""One torch.compile'd graph per megatron ``TransformerLayer`` (``MegatronConfig.compile_layers``).

Without Transformer Engine or Apex, megatron-core's local layer runs its RMSNorms, rotary
embedding, residual adds and the copies between them as separate eager kernels, forward and
backward, with host time between them (on the 1.5B shape: ~32 ms of norms and elementwise
kernels and ~24 ms of idle gaps in a 217 ms step). Compiled, each layer's forward and
backward are one graph each: the memory-bound parts fused around the matmuls and the SDPA
kernel, no Python between them (rl-fsdp does the same for HF decoder layers,
:mod:`rl_fsdp.fusion`).

What is compiled, by layer and layout (:func:`whole_layer_compiles`):

- the whole layer: dense layers (MLA included) at tp = 1, at any pp, vpp and cp (the
  key/value all-gather of :mod:`rl_megatron.attention` and its backward are traced as
  functional collectives), also under megatron's full recompute (its checkpoint calls the
  compiled layer without grad and again in backward; grad mode is part of the guards);
- its RMSNorms only: MoE layers (data-dependent token dispatch; routing replay's router
  hooks), tp > 1 (megatron's asynchronous TP / SP collectives, ``async_op=True``, break
  the graph: 12 breaks over two layers at TP=2) and selective recompute (megatron
  checkpoints inside the layer).

Two megatron-core calls that dynamo cannot trace are kept out of the graph, with the same
results: ``make_viewless_tensor`` (a ``.data`` swap) runs on the compiled layer's output
instead, and the TP group lookup that ``RowParallelLinear`` makes with ``tp_group=None``
skips its deprecation warning (a graph break) while compiling.

The token and row dimensions (0 and 1 of ``[s, b, h]``) are dynamic from the first call:
one graph serves every micro-batch shape. A module class whose compiled forward raises
runs eager from then on (every module of that class), logged once and kept in
:data:`COMPILE_FAILURES`.
"""

import functools
import logging

import torch

from rl_core import compiling

logger = logging.getLogger(__name__)

COMPILE_FAILURES = compiling.COMPILE_FAILURES  # "Class: error" of every class fallen back


class CompiledOrEager(compiling.CompiledOrEager):
    """:class:`rl_core.compiling.CompiledOrEager` for megatron's ``[s, b, h]`` modules:
    tokens and rows dynamic; a failure logged. ``viewless``: the output's first tensor
    made viewless outside the graph, as megatron's layer does (the pipeline schedules
    free a stage's output through ``.data``)."""

    def __init__(self, module, *, backend, failed_classes: set, viewless: bool = False):
        super().__init__(module, backend=backend, failed_classes=failed_classes)
        self.viewless = viewless

    def mark_dynamic(self, args: tuple, kwargs: dict) -> None:
        _mark_tokens_dynamic(args, kwargs)

    def finish(self, output):
        return _made_viewless(output) if self.viewless else output

    def report_failure(self, error: Exception) -> None:
        logger.warning("torch.compile of %s failed, running it eager: %r", self.name, error)


def _mark_tokens_dynamic(args: tuple, kwargs: dict) -> None:
    """Dims 0 and 1 (tokens, rows of ``[s, b, ...]``) of the hidden states (a layer's or a
    norm's input) and dim 0 of the rotary input (angles ``[s, 1, 1, d]`` or the cos/sin
    table ``[s, 1, 1, 2, d]`` of :mod:`rl_megatron.rotary`): one graph for every
    micro-batch shape."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 3:
        torch._dynamo.maybe_mark_dynamic(hidden, 0)
        torch._dynamo.maybe_mark_dynamic(hidden, 1)
    rotary = kwargs.get("rotary_pos_emb")
    if isinstance(rotary, torch.Tensor):
        torch._dynamo.maybe_mark_dynamic(rotary, 0)


def _made_viewless(output):
    from megatron.core.utils import make_viewless_tensor

    hidden, *rest = output
    viewless = make_viewless_tensor(hidden, requires_grad=hidden.requires_grad, keep_graph=True)
    return (viewless, *rest)


def whole_layer_compiles(layer, config) -> bool:
    """Whether ``layer`` is compiled whole (see the module docstring), else its norms only."""
    dense = not getattr(layer, "is_moe_layer", False)
    untraced = config.tensor_model_parallel_size > 1 or config.recompute_granularity == "selective"
    return dense and not untraced


def compile_layers(chunks, *, backend="inductor") -> dict[str, int]:
    """Compile the transformer layers of every model chunk in place (parameter names
    unchanged): each whole where :func:`whole_layer_compiles`, else its RMSNorms.
    Returns ``{"whole_layers": n, "norms_only_layers": m}``. Idempotent."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    _graph_safe_megatron()
    compiling.raise_recompile_limit()
    failed: set[str] = set()
    counts = {"whole_layers": 0, "norms_only_layers": 0}
    for chunk in chunks:
        for layer in (m for m in chunk.modules() if isinstance(m, TransformerLayer)):
            whole = whole_layer_compiles(layer, chunk.config)
            modules = [layer] if whole else _norms(layer)
            for module in modules:
                if not isinstance(module.__dict__.get("forward"), CompiledOrEager):
                    module.forward = CompiledOrEager(
                        module, backend=backend, failed_classes=failed, viewless=whole
                    )
            counts["whole_layers" if whole else "norms_only_layers"] += 1
    return counts


def _norms(layer) -> list[torch.nn.Module]:
    return [m for m in layer.modules() if isinstance(m, torch.nn.RMSNorm)]


def compiled_count(chunks) -> tuple[int, int]:
    """``(compiled, fallen back to eager)`` counts of the wrapped modules in ``chunks``."""
    wrappers = compiling.wrapped_forwards(m for chunk in chunks for m in chunk.modules())
    failed = sum(w.failed for w in wrappers)
    return len(wrappers) - failed, failed


@functools.cache
def _graph_safe_megatron() -> None:
    """Keep megatron's two untraceable calls out of the graphs (module docstring)."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import transformer_layer

    viewless = transformer_layer.make_viewless_tensor
    group_of = layers.get_tensor_model_parallel_group_if_none

    def make_viewless_tensor(inp, requires_grad, keep_graph):
        if torch.compiler.is_compiling():  # done on the compiled layer's output instead
            return inp
        return viewless(inp, requires_grad, keep_graph)

    def get_tensor_model_parallel_group_if_none(tp_group, is_expert=False, **kwargs):
        if tp_group is None and torch.compiler.is_compiling():  # the lookup, unwarned
            from megatron.core import parallel_state as ps

            get = ps.get_expert_tensor_parallel_group if is_expert else None
            return (get or ps.get_tensor_model_parallel_group)(**kwargs)
        return group_of(tp_group, is_expert=is_expert, **kwargs)

    transformer_layer.make_viewless_tensor = make_viewless_tensor
    layers.get_tensor_model_parallel_group_if_none = get_tensor_model_parallel_group_if_none
