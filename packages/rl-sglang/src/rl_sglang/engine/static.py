"""A static-shape decode path for Llama-family models (Llama, Qwen2, Mistral): a slot KV
cache and, on CUDA, one CUDA graph per batch bucket.

Running request ``i`` owns slot ``i`` of a preallocated cache ``[S, Hkv, T_max, D]`` per
layer (slots stay compact: a finished row's slot is refilled by moving the last one in).
Prefill runs the HF model on the new prompts and copies their keys/values into free
slots; decode runs the HF layers' own modules (norms, projections, rotary, MLP) with a
per-slot position, writes the new key/value at that position and attends over the whole
slot with a length mask, so every shape is fixed and the step can be graph-captured.
"""

import torch

from rl_sglang.engine.runner import ModelRunner

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def supports_static(model) -> bool:
    """True for the architectures whose layer wiring :class:`StaticRunner` reproduces."""
    config = model.config
    return config.model_type in SUPPORTED_MODEL_TYPES and not getattr(
        config, "use_sliding_window", False
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StaticBatch:
    """Handle of the running rows (row i = slot i); the runner owns the tensors."""

    def __init__(self, size: int):
        self.size = size


class StaticRunner:
    """Prefill/decode/merge/select over slots, the same interface as the dynamic path."""

    def __init__(self, model, *, max_slots: int, max_len: int, cuda_graphs: bool | None = None):
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
        shape = (max_slots, config.num_key_value_heads, max_len, self.head_dim)
        self.keys = [
            torch.zeros(shape, dtype=param.dtype, device=param.device) for _ in model.model.layers
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.lengths = torch.zeros(max_slots, dtype=torch.long, device=param.device)
        self.host_lengths: list[int] = []  # mirror of lengths[:size], read without a sync
        self.size = 0
        use_graphs = param.is_cuda if cuda_graphs is None else cuda_graphs
        self.graphs = _GraphCache(self) if use_graphs else None
        if self.graphs is not None:  # before any request: capture writes into free slots
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
        for row, prompt in enumerate(prompts):
            slot, length = self.size + row, len(prompt)
            for layer, (k, v) in enumerate(state.kv):
                self.keys[layer][slot, :, :length] = k[row, :, width - length :]
                self.values[layer][slot, :, :length] = v[row, :, width - length :]
            self.lengths[slot] = length
        self.host_lengths.extend(len(p) for p in prompts)
        return logits_BV, StaticBatch(len(prompts))

    def merge(self, state: StaticBatch | None, new: StaticBatch) -> StaticBatch:
        self.size += new.size
        return StaticBatch(self.size)

    def select(self, state: StaticBatch, rows: list[int]) -> StaticBatch | None:
        """Keep ``rows`` in order by moving their slots to the front."""
        if rows != list(range(len(rows))):
            index = torch.tensor(rows, device=self.device)
            for cache in (*self.keys, *self.values):
                cache[: len(rows)] = cache.index_select(0, index)
            self.lengths[: len(rows)] = self.lengths.index_select(0, index)
        self.host_lengths = [self.host_lengths[r] for r in rows]
        self.size = len(rows)
        return StaticBatch(self.size) if rows else None

    @torch.inference_mode()
    def decode(self, state: StaticBatch, tokens_B: torch.Tensor) -> torch.Tensor:
        """Feed one token per running row; returns logits ``[B, V]``."""
        size = state.size
        if max(self.host_lengths) >= self.max_len:
            raise ValueError(f"a request outgrew max_len {self.max_len}; raise --max-context")
        if self.graphs is not None:
            logits_BV = self.graphs.run(tokens_B, size)
        else:
            logits_BV = self.step(tokens_B.to(self.device), self.lengths[:size].clone())
        self.lengths[:size] += 1
        self.host_lengths = [n + 1 for n in self.host_lengths]
        return logits_BV

    # ---- one static-shape decode step ---------------------------------------------------
    def step(self, tokens_B: torch.Tensor, positions_B: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` for ``tokens_B`` at ``positions_B``; writes K/V of slots 0..B-1."""
        inner = self.model.model
        hidden_BH = inner.embed_tokens(tokens_B)
        cos, sin = inner.rotary_emb(hidden_BH[:, None, :], positions_B[:, None])
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, 1, D], broadcast over heads
        visible = torch.arange(self.max_len, device=self.device)[None, :] <= positions_B[:, None]
        mask_B11T = visible[:, None, None, :]
        for index, layer in enumerate(inner.layers):
            attn_in = layer.input_layernorm(hidden_BH)
            attn_out = self._attention(
                layer.self_attn, index, attn_in, cos, sin, positions_B, mask_B11T
            )
            hidden_BH = hidden_BH + attn_out
            hidden_BH = hidden_BH + layer.mlp(layer.post_attention_layernorm(hidden_BH))
        return self.model.lm_head(inner.norm(hidden_BH)).float()

    def _attention(self, attn, index, x_BH, cos, sin, positions_B, mask_B11T) -> torch.Tensor:
        batch = x_BH.shape[0]
        q = attn.q_proj(x_BH).view(batch, -1, 1, self.head_dim)  # [B, Hq, 1, D]
        k = attn.k_proj(x_BH).view(batch, -1, 1, self.head_dim)
        v = attn.v_proj(x_BH).view(batch, -1, 1, self.head_dim)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        rows = torch.arange(batch, device=self.device)
        self.keys[index][rows, :, positions_B] = k[:, :, 0]
        self.values[index][rows, :, positions_B] = v[:, :, 0]
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            self.keys[index][:batch],
            self.values[index][:batch],
            attn_mask=mask_B11T,
            enable_gqa=True,
        )
        return attn.o_proj(out.reshape(batch, -1))


class _GraphCache:
    """One CUDA graph per batch bucket (powers of two up to ``max_slots``)."""

    def __init__(self, runner: StaticRunner):
        self.runner = runner
        self.buckets = sorted(
            {min(1 << i, runner.max_slots) for i in range(runner.max_slots.bit_length() + 1)}
        )
        self.graphs: dict[int, tuple] = {}
        self.pool = None

    @torch.inference_mode()
    def capture_all(self) -> None:
        for bucket in self.buckets:
            self.graphs[bucket] = self._capture(bucket)
        self.runner.lengths.zero_()

    def run(self, tokens_B: torch.Tensor, size: int) -> torch.Tensor:
        bucket = next(b for b in self.buckets if b >= size)
        graph, tokens_in, positions_in, logits_out = self.graphs[bucket]
        tokens_in.zero_()
        positions_in.zero_()  # padding rows write into their (free) slot's position 0
        tokens_in[:size] = tokens_B
        positions_in[:size] = self.runner.lengths[:size]
        graph.replay()
        return logits_out[:size].clone()

    def _capture(self, bucket: int):
        device = self.runner.device
        tokens_in = torch.zeros(bucket, dtype=torch.long, device=device)
        positions_in = torch.zeros(bucket, dtype=torch.long, device=device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (allocations, autotuning)
                self.runner.step(tokens_in, positions_in)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits_out = self.runner.step(tokens_in, positions_in)
        self.pool = graph.pool()
        return graph, tokens_in, positions_in, logits_out
