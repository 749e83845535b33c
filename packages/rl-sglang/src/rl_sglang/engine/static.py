"""A static-shape decode path for Llama-family models (Llama, Qwen2, Mistral): a slot KV
cache and, on CUDA, one CUDA graph per batch bucket.

Running request ``i`` owns slot ``i`` of a preallocated cache ``[S, Hkv, T_max, D]`` per
layer (slots stay compact: a finished row's slot is refilled by moving the last one in).
Prefill runs the HF model on the new prompts and copies their keys/values into free
slots; decode runs the HF layers' own modules (norms, projections, rotary, MLP) with a
per-slot position, writes the new key/value at that position and attends over the whole
slot with a length mask, so every shape is fixed and the step can be graph-captured.

The step keeps the GPU kernel count low (see :mod:`rl_sglang.engine.layers`), builds the
attention mask once per step, and computes the greedy token and its log-prob inside the
step, so an all-greedy batch needs no kernel outside the graph but two small copies.
"""

import logging

import torch

from rl_sglang.engine.graphs import GraphCache
from rl_sglang.engine.layers import LayerWeights, decode_layer, norm_eps, rms_norm, signed_sin
from rl_sglang.engine.runner import ModelRunner
from rl_sglang.engine.sampling import greedy_pick

logger = logging.getLogger(__name__)
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def supports_static(model) -> bool:
    """True for the architectures whose layer wiring :class:`StaticRunner` reproduces."""
    config = model.config
    return (
        config.model_type in SUPPORTED_MODEL_TYPES
        and not getattr(config, "use_sliding_window", False)
        and getattr(config, "hidden_act", "silu") == "silu"
    )


class StaticBatch:
    """Handle of the running rows (row i = slot i); the runner owns the tensors."""

    def __init__(self, size: int):
        self.size = size


class StaticRunner:
    """Prefill/decode/merge/select over slots, the same interface as the dynamic path.

    ``compile=True`` runs each decoder layer through one ``torch.compile`` of
    :func:`decode_layer` (fusing its elementwise kernels; the same compiled code serves all
    layers) before the graphs are captured; if that fails the eager layer is kept.
    """

    def __init__(self, model, *, max_slots: int, max_len: int, cuda_graphs: bool | None = None,
                 compile: bool = False):  # fmt: skip
        if not supports_static(model):
            raise ValueError(
                f"static decoding supports {SUPPORTED_MODEL_TYPES}, not {model.config.model_type}"
            )
        self.model, self.max_slots, self.max_len = model, max_slots, max_len
        self.prefiller = ModelRunner(model, pad_token_id=model.config.pad_token_id or 0)
        config, param = model.config, next(model.parameters())
        self.head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.num_heads = config.num_attention_heads
        self.cache_len = -(-max_len // 16) * 16  # aligned rows for the fused attention kernels
        shape = (max_slots, config.num_key_value_heads, self.cache_len, self.head_dim)
        self.keys = [
            torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in model.model.layers
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.lengths = torch.zeros(max_slots, dtype=torch.long, device=param.device)
        self.host_lengths: list[int] = []  # mirror of lengths[:size], read without a sync
        self.size = 0
        self.layers = [LayerWeights(layer) for layer in model.model.layers]
        self.eps = norm_eps(model.model.layers[0].input_layernorm)
        self.layer_fn = torch.compile(decode_layer, dynamic=True) if compile else decode_layer
        self.compiled = compile
        use_graphs = param.is_cuda if cuda_graphs is None else cuda_graphs
        self.graphs = GraphCache(self) if use_graphs else None
        if self.graphs is not None:  # before any request: capture writes into free slots
            self._capture()

    def _capture(self) -> None:
        try:
            self.graphs.capture_all()
        except Exception:  # a compiler failure must not take the engine down: go eager
            if not self.compiled:
                raise
            logger.exception("capturing the compiled decode step failed; using the eager one")
            self.layer_fn, self.compiled = decode_layer, False
            self.graphs = GraphCache(self)
            self.graphs.capture_all()

    @property
    def device(self) -> torch.device:
        return self.lengths.device

    # ---- the runner interface used by the scheduler -------------------------------------
    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, StaticBatch]:
        assert len(self.host_lengths) == self.size
        if self.size + len(prompts) > self.max_slots:
            raise ValueError(f"{self.size + len(prompts)} rows exceed {self.max_slots} slots")
        logits_BV, state = self.prefiller.prefill(prompts)
        width = state.mask_BT.shape[1]
        lengths = [len(p) for p in prompts]
        for length in set(lengths):  # one copy per layer and distinct prompt length
            rows = [row for row, n in enumerate(lengths) if n == length]
            slots = torch.tensor([self.size + r for r in rows], device=self.device)
            index = torch.tensor(rows, device=self.device)
            for layer, (k, v) in enumerate(state.kv):
                self.keys[layer][slots, :, :length] = k[index, :, width - length :]
                self.values[layer][slots, :, :length] = v[index, :, width - length :]
        new_lengths = torch.tensor(lengths, dtype=torch.long)
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
            target = torch.tensor([slot for slot, _ in moved], device=self.device)
            source = torch.tensor([row for _, row in moved], device=self.device)
            for cache in (*self.keys, *self.values, self.lengths):
                cache[target] = cache[source]
        self.host_lengths = [self.host_lengths[r] for r in rows]
        self.size = len(rows)
        return StaticBatch(self.size) if rows else None

    @torch.inference_mode()
    def decode(self, state: StaticBatch, tokens_B: torch.Tensor, *, greedy: bool = False):
        """Feed one token per running row. Returns logits ``[B, V]`` (a view, valid until
        the next decode), or with ``greedy`` the argmax tokens ``[B]`` and their log-probs."""
        size = state.size
        if max(self.host_lengths) >= self.max_len:
            raise ValueError(f"a request outgrew max_len {self.max_len}; raise --max-context")
        if self.graphs is not None:
            logits_BV, tokens_B, logprobs_B = self.graphs.run(tokens_B, size)
        else:
            outputs = self.step(tokens_B.to(self.device), self.lengths[:size])
            logits_BV, tokens_B, logprobs_B = outputs
        self.lengths[:size] += 1
        self.host_lengths = [n + 1 for n in self.host_lengths]
        return (tokens_B, logprobs_B) if greedy else logits_BV

    def refresh_weights(self) -> None:
        """Re-read the fused projection weights after the model's weights changed."""
        for layer in self.layers:
            layer.refresh()

    # ---- one static-shape decode step ---------------------------------------------------
    def step(self, tokens_B: torch.Tensor, positions_B: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Logits ``[B, V]`` (float32) for ``tokens_B`` at ``positions_B`` and the greedy
        token ``[B]`` and log-prob ``[B]`` of each row; writes K/V of slots 0..B-1."""
        inner = self.model.model
        positions_B = positions_B.clamp(max=self.max_len - 1)  # padding rows: stale lengths
        hidden_BH = inner.embed_tokens(tokens_B)
        cos, sin = inner.rotary_emb(hidden_BH[:, None, :], positions_B[:, None])  # [B, 1, D]
        sin = signed_sin(sin)
        columns_T = torch.arange(self.cache_len, device=self.device)
        hidden_mask_BT = columns_T[None, :] > positions_B[:, None]
        mask_BT = torch.zeros(hidden_mask_BT.shape, dtype=hidden_BH.dtype, device=self.device)
        mask_B11T = mask_BT.masked_fill(hidden_mask_BT, float("-inf"))[:, None, None, :]
        rows_B = torch.arange(tokens_B.shape[0], device=self.device)
        for index, layer in enumerate(self.layers):
            hidden_BH = self.layer_fn(
                hidden_BH, self.keys[index], self.values[index], rows_B, positions_B, cos, sin,
                mask_B11T, layer.tensors(), self.eps, self.num_heads, self.head_dim,
            )  # fmt: skip
        logits_BV = self.model.lm_head(rms_norm(inner.norm, hidden_BH)).float()
        return (logits_BV, *greedy_pick(logits_BV))
