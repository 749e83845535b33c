"""A static-shape decode path for Llama-family models (Llama, Qwen2, Mistral): a slot KV
cache and, on CUDA, one CUDA graph per batch bucket.

Running request ``i`` owns slot ``i`` of a preallocated cache ``[S, Hkv, T_max, D]`` per
layer (slots stay compact: a finished row's slot is refilled by moving the last one in).
Prefill runs the same fused layer pieces over the new prompts, right-padded, and writes
their keys/values straight into free slots (:mod:`rl_sglang.engine.prefill`); decode runs
the HF layers' own modules (norms, projections, rotary, MLP) with a per-slot position,
writes the new key/value at that position and attends over the slot's positions up to the
row's length (fused Triton kernels on CUDA; elsewhere SDPA over the whole slot with a
length mask built once per step), so every shape is fixed and the step can be
graph-captured.

The step keeps the GPU kernel count low (see :mod:`rl_sglang.engine.layers`) and computes the greedy token and its log-prob inside the
step, so an all-greedy batch needs no kernel outside the graph but two small copies.
"""

import logging
import math

import torch

from rl_sglang.engine.decode_attention import fused_decode_available, triton
from rl_sglang.engine.graphs import GraphCache
from rl_sglang.engine.layers import (
    LayerWeights,
    decode_layer,
    fuse_projections,
    fused_groups,
    fused_specs,
    norm_eps,
    rms_norm,
    signed_sin,
)
from rl_sglang.engine.prefill import prefill_into_slots
from rl_sglang.engine.rows import on_device
from rl_sglang.engine.sampling import RowParams, greedy_pick, sample_next
from rl_sglang.engine.stable_memory import StableMemory

logger = logging.getLogger(__name__)
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
# Families users bring whose layers the static runner does not reproduce, and why.
_UNSUPPORTED_FAMILIES = {
    "glm4": "output norms after attention and MLP, fused gate/up, partial interleaved rope",
    "deepseek_v3": "multi-latent attention and a sigmoid-routed MoE with shared experts",
}


def supports_static(model, max_context: int | None = None) -> bool:
    """True for the architectures whose layer wiring :class:`StaticRunner` reproduces."""
    return static_unsupported_reason(model, max_context) is None


def static_unsupported_reason(model, max_context: int | None = None) -> str | None:
    """Why :class:`StaticRunner` cannot take ``model`` for contexts of up to
    ``max_context`` tokens (default: the model's own limit), one line; None when it can."""
    config = model.config
    if config.model_type in _UNSUPPORTED_FAMILIES:
        return (
            f"{config.model_type} ({_UNSUPPORTED_FAMILIES[config.model_type]}) is served by "
            "the dynamic runner (the HF model's own forward)"
        )
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention (use_sliding_window) is not supported"
    window = _sliding_window(config)
    limit = max_context or getattr(config, "max_position_embeddings", None)
    if window is not None and (limit is None or window < limit):
        return (
            f"{config.model_type} sliding-window attention (sliding_window={window} < context "
            f"{limit}) is not supported; give --max-context {window} or use the dynamic runner"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    return None


def slot_cache_shape(config, max_slots: int, max_len: int) -> tuple[int, int, int, int]:
    """``[slots, key/value heads, rows, head dim]`` of one layer's key (or value) cache:
    rows aligned to 16 for the fused attention kernels."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return (max_slots, heads, -(-max_len // 16) * 16, head_dim)


def slot_cache_bytes(model, max_slots: int, max_len: int) -> int:
    """Bytes of the keys and values of ``max_slots`` slots of ``max_len`` positions in every
    layer, in the model's dtype."""
    per_layer = math.prod(slot_cache_shape(model.config, max_slots, max_len))
    itemsize = next(model.parameters()).element_size()
    return 2 * model.config.num_hidden_layers * per_layer * itemsize


ACTIVATION_RESERVE = 1 << 30  # bytes kept for prefill activations outside the slots


def slots_that_fit(model, max_len: int, budget_bytes: int) -> int:
    """How many slots of ``max_len`` positions fit in ``budget_bytes`` of device memory
    beside the weights: each slot costs its keys and values in every layer plus its
    rows of the graphs' logits (the model's dtype, float32 for the greedy pick, and again
    for the K-step graphs); :data:`ACTIVATION_RESERVE` is kept for prefills."""
    itemsize = next(model.parameters()).element_size()
    logits = 2 * model.config.vocab_size * (itemsize + 4)
    per_slot = slot_cache_bytes(model, 1, max_len) + logits
    return max(0, (budget_bytes - ACTIVATION_RESERVE) // per_slot)


def _sliding_window(config) -> int | None:
    """The window of the layers that have one (None when no layer does)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None
    return getattr(config, "sliding_window", None)


def upcast_greedy_pick(logits_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`greedy_pick` of the float32 logits; compiled, the upcast is fused into the
    reductions instead of written out (sampling upcasts the same logits itself)."""
    return greedy_pick(logits_BV.float())


def rotary_table(rotary: torch.nn.Module, max_len: int, like: torch.Tensor):
    """``(cos, signed sin)`` ``[max_len, D]`` of every position from the model's own rotary
    module (each position's values do not depend on the others, so a lookup equals the
    module's output bit for bit); None for rope types whose frequencies change with the
    sequence length."""
    if getattr(rotary, "rope_type", "default") in ("dynamic", "longrope"):
        return None
    positions = torch.arange(max_len, device=like.device)[None]
    with torch.no_grad():
        cos, sin = rotary(torch.zeros((1, 1), dtype=like.dtype, device=like.device), positions)
    return cos[0].contiguous(), signed_sin(sin)[0].contiguous()


def _fused_attention(choice: str, device: torch.device) -> bool:
    """Whether the decode step runs :func:`~rl_sglang.engine.decode_attention.decode_attention`
    (``"triton"``; ``"auto"``: where :func:`fused_decode_available`) or SDPA with a
    length mask (``"sdpa"``)."""
    if choice not in ("auto", "triton", "sdpa"):
        raise ValueError(f"decode attention {choice!r} is not one of auto, triton, sdpa")
    if choice == "triton" and triton is None:
        raise ValueError("decode attention 'triton' needs the triton package")
    return choice == "triton" or (choice == "auto" and fused_decode_available(device))


class StaticBatch:
    """Handle of the running rows (row i = slot i); the runner owns the tensors."""

    def __init__(self, size: int):
        self.size = size


class StaticRunner:
    """Prefill/decode/merge/select over slots, the same interface as the dynamic path.

    ``compile=True`` runs each decoder layer through one ``torch.compile`` of
    :func:`decode_layer` (fusing its elementwise kernels; the same compiled code serves all
    layers), and the greedy pick through another, before the graphs are captured; if that
    fails the eager functions are kept.

    ``sampled_multi_step``: sampled rounds of ``multi_step`` K steps too (each step's draw
    inside the round, :meth:`decode_sampled`), not only greedy ones.

    ``attention``: the decode step's attention, ``"triton"`` (two kernels reading each
    row's length, :mod:`rl_sglang.engine.decode_attention`), ``"sdpa"`` (SDPA over the
    whole slot with a length mask) or ``"auto"`` (Triton on CUDA where it is installed).

    ``stable_memory=True`` (CUDA) puts the weights (q/k/v and gate/up fused) and the
    slot caches in address-stable memory (:mod:`rl_sglang.engine.stable_memory`): a
    release then unmaps them and a resume maps them back at the same addresses, so the
    graphs are captured once for the run instead of at every resume. Where the driver
    cannot, it falls back to freeing and capturing again.
    """

    def __init__(
        self,
        model,
        *,
        max_slots: int,
        max_len: int,
        cuda_graphs: bool | None = None,
        compile: bool = False,
        multi_step: int = 1,
        sampled_multi_step: bool = False,
        stable_memory: bool = False,
        attention: str = "auto",
    ):
        if (reason := static_unsupported_reason(model, max_len)) is not None:
            raise ValueError(f"static decoding cannot take this model: {reason}")
        self.model, self.max_slots, self.max_len = model, max_slots, max_len
        config = model.config
        self.cache_shape = slot_cache_shape(config, max_slots, max_len)
        self.cache_len, self.head_dim = self.cache_shape[2], self.cache_shape[3]
        self.num_heads = config.num_attention_heads
        self.eps = norm_eps(model.model.layers[0].input_layernorm)
        pick = upcast_greedy_pick
        self.layer_fn = torch.compile(decode_layer, dynamic=True) if compile else decode_layer
        self.pick_fn = torch.compile(pick, dynamic=True) if compile else pick
        self.compiled = compile
        self.use_graphs = next(model.parameters()).is_cuda if cuda_graphs is None else cuda_graphs
        self.multi_step = multi_step
        self.sampled_multi_step = sampled_multi_step and multi_step > 1
        self.fused_attention = _fused_attention(attention, next(model.parameters()).device)
        self.keys = None  # set by resume()
        self.stable = self._stable_memory() if stable_memory else None
        self.resume()

    def _stable_memory(self) -> StableMemory | None:
        """Stable memory holding the model's parameters (moved there now, kept across
        releases: q/k/v and gate/up as the fused tensors the decode step reads, each
        projection a slice of its group's) with room after them for the slot caches."""
        layers = self.model.model.layers
        projections = [m for layer in layers for group in fused_groups(layer) for m in group]
        fused = {id(t) for m in projections for t in (m.weight, m.bias) if t is not None}
        params = list(self.model.parameters())
        specs = [(p.shape, p.dtype) for p in params if id(p) not in fused]
        specs += [spec for layer in layers for spec in fused_specs(layer)]
        specs += [((len(layers), *self.cache_shape), params[0].dtype)] * 2  # keys, values
        memory = StableMemory.for_bytes(StableMemory.size_of(specs), params[0].device)
        if memory is not None:
            with torch.no_grad():
                for layer in layers:
                    fuse_projections(layer, memory.take)
                for param in params:
                    if id(param) not in fused:
                        param.data = memory.adopt(param.data)
            memory.keep_contents()
            torch.cuda.empty_cache()  # the parameters' previous storage
        return memory

    def resume(self) -> None:
        """Allocate the slot caches on the model's device, fuse the layers' projections
        (unless fused where they lie) and capture the graphs: at start, and after
        :meth:`release` once the model is back on the device. The compiled functions are
        kept, so a resume captures but does not compile again.
        With stable memory a resume maps the memory back instead: tensors and graphs
        keep their addresses, the caches come back zeroed."""
        if self.stable is not None and self.keys is not None:
            self.stable.restore()  # the weights, fused projections included, come back
            self.lengths.zero_()
            self.host_lengths, self.size = [], 0
            return
        param, layers = next(self.model.parameters()), self.model.model.layers
        empty = self.stable.take if self.stable is not None else None
        # Every layer's keys in one tensor (values likewise), so moving slots is one copy
        # for all layers; the decode step and the graphs read per-layer views.
        caches_shape = (len(layers), *self.cache_shape)
        self.caches = tuple(self._zeros(caches_shape, param, empty) for _ in ("keys", "values"))
        self.keys, self.values = (list(cache.unbind()) for cache in self.caches)
        self.lengths = torch.zeros(self.max_slots, dtype=torch.long, device=param.device)
        self.host_lengths: list[int] = []  # mirror of lengths[:size], read without a sync
        self.size = 0
        self.layers = [LayerWeights(layer) for layer in layers]  # stable: fused already
        self.rotary_table = rotary_table(self.model.model.rotary_emb, self.max_len, param)
        self.columns_T = torch.arange(self.cache_len, device=param.device)
        self.mask_values = tuple(
            torch.tensor(v, dtype=param.dtype, device=param.device) for v in (float("-inf"), 0.0)
        )
        self.graphs = GraphCache(self, self.multi_step) if self.use_graphs else None
        if self.graphs is not None:  # before any request: capture writes into free slots
            self._capture()

    @staticmethod
    def _zeros(shape, like: torch.Tensor, empty=None) -> torch.Tensor:
        if empty is None:
            return torch.zeros(shape, dtype=like.dtype, device=like.device)
        return empty(shape, like.dtype).zero_()

    def release(self, *, keep_weights: bool = True) -> None:
        """Drop every device tensor this runner owns (caches, graphs and their memory
        pool; the fused projections are the model's own weights) so the model can leave
        the device; :meth:`resume` rebuilds them. With stable memory, unmap it instead
        (the weights wait in pinned host memory, or with ``keep_weights=False`` are
        dropped and come back zeroed; the graphs, their pool and the small tensors stay).
        Running rows must have been retracted first."""
        assert self.size == 0, "release with rows still running"
        if self.stable is not None:
            self.stable.release(keep=keep_weights)
            return
        self.graphs = self.caches = self.keys = self.values = self.layers = None
        self.lengths = self.rotary_table = self.columns_T = self.mask_values = None

    def _capture(self) -> None:
        try:
            self.graphs.capture_all()
        except Exception:  # a compiler failure must not take the engine down: go eager
            if not self.compiled:
                raise
            logger.exception("capturing the compiled decode step failed; using the eager one")
            self.layer_fn, self.pick_fn, self.compiled = decode_layer, upcast_greedy_pick, False
            self.graphs = GraphCache(self, self.multi_step)
            self.graphs.capture_all()

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    # ---- the runner interface used by the scheduler -------------------------------------
    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, StaticBatch]:
        assert len(self.host_lengths) == self.size
        if self.size + len(prompts) > self.max_slots:
            raise ValueError(f"{self.size + len(prompts)} rows exceed {self.max_slots} slots")
        logits_BV = prefill_into_slots(self, prompts, first_slot=self.size)
        lengths = [len(p) for p in prompts]
        new_lengths = on_device(lengths, torch.long, self.device)
        self.lengths[self.size : self.size + len(prompts)].copy_(new_lengths)
        self.host_lengths.extend(lengths)
        return logits_BV, StaticBatch(len(prompts))

    def merge(self, state: StaticBatch | None, new: StaticBatch) -> StaticBatch:
        self.size += new.size
        return StaticBatch(self.size)

    def select(self, state: StaticBatch, rows: list[int]) -> StaticBatch | None:
        """Keep ``rows`` in order by moving their slots to the front."""
        moved = [(slot, row) for slot, row in enumerate(rows) if slot != row]
        if moved:  # copy only the slots that change
            target = on_device([slot for slot, _ in moved], torch.long, self.device)
            source = on_device([row for _, row in moved], torch.long, self.device)
            for cache in self.caches:  # [layers, slots, ...]: every layer in one copy
                cache[:, target] = cache[:, source]
            self.lengths[target] = self.lengths[source]
        self.host_lengths = [self.host_lengths[r] for r in rows]
        self.size = len(rows)
        return StaticBatch(self.size) if rows else None

    @torch.inference_mode()
    def decode(
        self, state: StaticBatch, tokens_B: torch.Tensor, *, greedy: bool = False, steps: int = 1
    ):
        """Feed one token per running row. Returns logits ``[B, V]`` (a view, valid until
        the next decode), or with ``greedy`` the argmax tokens ``[B]`` and their log-probs;
        ``steps`` = K > 1 (greedy, K = :attr:`multi_step`): K steps, each fed the previous
        argmax, their tokens and log-probs ``[K, B]``."""
        size = state.size
        if max(self.host_lengths) + steps - 1 >= self.max_len:
            raise ValueError(f"a request outgrew max_len {self.max_len}; raise --max-context")
        if steps > 1 and (not greedy or steps != self.multi_step):
            raise ValueError(f"multi-step decoding is greedy with {self.multi_step} steps")
        if steps > 1:
            outputs = (
                self.graphs.run(tokens_B, size, steps)
                if self.graphs is not None
                else self.greedy_steps(tokens_B.to(self.device, copy=True), size, steps)
            )
            self.host_lengths = [n + steps for n in self.host_lengths]
            return outputs
        if self.graphs is not None:
            logits_BV, tokens_B, logprobs_B = self.graphs.run(tokens_B, size)
        else:
            outputs = self.step(tokens_B.to(self.device), self.lengths[:size])
            logits_BV, tokens_B, logprobs_B = outputs
        self.lengths[:size] += 1
        self.host_lengths = [n + 1 for n in self.host_lengths]
        return (tokens_B, logprobs_B) if greedy else logits_BV

    def greedy_steps(self, tokens_B: torch.Tensor, size: int, steps: int):
        """``steps`` greedy decode steps of rows ``0..size-1``, each fed the previous
        argmax (in place in ``tokens_B``), ``lengths`` advanced after each; the tokens and
        log-probs ``[K, B]``. Captured whole as one graph on CUDA."""
        return self._steps(tokens_B, size, steps, lambda outputs: outputs[1:])

    @torch.inference_mode()
    def decode_sampled(
        self, state: StaticBatch, tokens_B: torch.Tensor, rows: RowParams, positions_B, steps: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``steps`` = K (:attr:`multi_step`) sampled decode steps of the running rows, each
        drawing by :func:`sample_next` with ``rows``' parameters and feeding its token to the
        next; ``positions_B``: the response index of each row's first draw (None: no row is
        seeded). The tokens and log-probs ``[K, B]``: what K single steps, each followed by
        :func:`sample_next`, give a seeded row (an unseeded row draws other numbers)."""
        if steps != self.multi_step or not self.sampled_multi_step:
            raise ValueError(
                f"sampled multi-step rounds need sampled_multi_step and {self.multi_step} steps"
            )
        size = state.size
        if max(self.host_lengths) + steps - 1 >= self.max_len:
            raise ValueError(f"a request outgrew max_len {self.max_len}; raise --max-context")
        if self.graphs is not None:
            outputs = self.graphs.run_sampled(tokens_B, size, rows, positions_B)
        else:
            positions_B = None if positions_B is None else positions_B.clone()
            tokens_B = tokens_B.to(self.device, copy=True)
            outputs = self.sampled_steps(tokens_B, size, steps, rows, positions_B)
        self.host_lengths = [n + steps for n in self.host_lengths]
        return outputs

    def sampled_steps(self, tokens_B, size: int, steps: int, rows: RowParams, positions_B):
        """:meth:`greedy_steps` with each token drawn by :func:`sample_next` (in place in
        ``tokens_B``; ``positions_B`` advanced after each draw). Captured whole on CUDA."""

        def draw(outputs):
            drawn = sample_next(outputs[0], rows, positions_B)
            if positions_B is not None:
                positions_B.add_(1)  # in place: the captured graph advances it
            return drawn

        return self._steps(tokens_B, size, steps, draw)

    def _steps(self, tokens_B, size: int, steps: int, pick):
        """``steps`` decode steps, each step's outputs (logits, greedy token, log-prob) turned
        into the next token and its log-prob by ``pick``, fed back in place in ``tokens_B``;
        the tokens and log-probs ``[K, B]``."""
        tokens, logprobs = [], []
        for _ in range(steps):
            next_B, logprob_B = pick(self.step(tokens_B, self.lengths[:size]))
            tokens_B.copy_(next_B)
            self.lengths[:size] += 1
            tokens.append(next_B)
            logprobs.append(logprob_B)
        return torch.stack(tokens), torch.stack(logprobs)

    # ---- one static-shape decode step ---------------------------------------------------
    def step(self, tokens_B: torch.Tensor, positions_B: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Logits ``[B, V]`` (the model's dtype) for ``tokens_B`` at ``positions_B`` and the greedy
        token ``[B]`` and log-prob ``[B]`` of each row; writes K/V of slots 0..B-1."""
        inner = self.model.model
        positions_B = positions_B.clamp(max=self.max_len - 1)  # padding rows: stale lengths
        hidden_BH = inner.embed_tokens(tokens_B)
        if self.rotary_table is not None:  # two gathers instead of the module's kernels
            cos, sin = (table[positions_B][:, None] for table in self.rotary_table)
        else:
            cos, sin = inner.rotary_emb(hidden_BH[:, None, :], positions_B[:, None])
            sin = signed_sin(sin)  # cos, sin: [B, 1, D]
        mask_B11T = None  # the fused kernels read each row's length from positions_B
        if not self.fused_attention:
            hidden_BT = self.columns_T[None, :] > positions_B[:, None]
            mask_B11T = torch.where(hidden_BT, *self.mask_values)[:, None, None, :]  # 0, -inf
        rows_B = torch.arange(tokens_B.shape[0], device=self.device)
        for index, layer in enumerate(self.layers):
            hidden_BH = self.layer_fn(
                hidden_BH,
                self.keys[index],
                self.values[index],
                rows_B,
                positions_B,
                cos,
                sin,
                mask_B11T,
                layer.tensors(),
                self.eps,
                self.num_heads,
                self.head_dim,
            )
        logits_BV = self.model.lm_head(rms_norm(inner.norm, hidden_BH))
        return (logits_BV, *self.pick_fn(logits_BV))
