"""Batched prefill and decode of an HF causal LM over a left-padded KV cache.

The running batch keeps, per layer, keys and values ``[B, H, T, D]`` and one attention mask
``[B, T]`` (1 = real token, 0 = left padding). New requests are prefilled as their own
left-padded batch and merged in by padding the shorter cache on the left; finished rows are
dropped by index. Positions come from the mask (``cumsum - 1``), so a row's logits do not
depend on its padding or its batch mates (up to float rounding).
"""

from dataclasses import dataclass

import torch

from rl_sglang.engine.sampling import greedy_pick

KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class BatchState:
    """KV cache and attention mask of the running batch; ``kv[i] = (keys, values)``,
    each ``[B, H, T, D]``; ``mask_BT`` long."""

    kv: KV
    mask_BT: torch.Tensor

    @property
    def size(self) -> int:
        return self.mask_BT.shape[0]


def _cache_from(kv: KV | None):
    from transformers import DynamicCache

    return DynamicCache() if kv is None else DynamicCache(ddp_cache_data=kv)


def _kv_of(cache) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


class ModelRunner:
    """Runs the model's forward for prefill and decode steps of a :class:`BatchState`."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int = 0):
        self.model = model
        self.pad_token_id = pad_token_id

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, BatchState]:
        """Last-position logits ``[B, V]`` and the new batch's state, prompts left-padded."""
        length = max(len(p) for p in prompts)
        ids_BT = torch.full((len(prompts), length), self.pad_token_id, dtype=torch.long)
        mask_BT = torch.zeros((len(prompts), length), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids_BT[row, length - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask_BT[row, length - len(prompt) :] = 1
        ids_BT, mask_BT = ids_BT.to(self.device), mask_BT.to(self.device)
        logits_BV, kv = self._forward(ids_BT, mask_BT, None)
        return logits_BV, BatchState(kv=kv, mask_BT=mask_BT)

    @torch.inference_mode()
    def decode(
        self, state: BatchState, tokens_B: torch.Tensor, *, greedy: bool = False, steps: int = 1
    ):
        """Feed one token per row; extends ``state`` in place; returns logits ``[B, V]``,
        or with ``greedy`` the argmax tokens ``[B]`` and their log-probs ``[B]``."""
        if steps != 1:
            raise ValueError("the dynamic runner decodes one step per call; use steps=1")
        ones_B1 = torch.ones((state.size, 1), dtype=torch.long, device=self.device)
        state.mask_BT = torch.cat([state.mask_BT, ones_B1], dim=1)
        logits_BV, state.kv = self._forward(
            tokens_B[:, None].to(self.device), state.mask_BT, state.kv
        )
        return greedy_pick(logits_BV) if greedy else logits_BV

    def merge(self, state: "BatchState | None", new: "BatchState") -> "BatchState":
        return merge(state, new)

    def select(self, state: "BatchState", rows: list[int]) -> "BatchState | None":
        return select(state, rows)

    def _forward(self, ids_BT, mask_BT, kv: KV | None) -> tuple[torch.Tensor, KV]:
        positions_BT = (mask_BT.cumsum(dim=-1) - 1).clamp(min=0)[:, -ids_BT.shape[1] :]
        out = self.model(
            input_ids=ids_BT,
            attention_mask=mask_BT,
            position_ids=positions_BT,
            past_key_values=_cache_from(kv),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].float(), _kv_of(out.past_key_values)


def merge(a: BatchState | None, b: BatchState) -> BatchState:
    """Concatenate two batches along B, left-padding the shorter cache."""
    if a is None:
        return b
    length = max(a.mask_BT.shape[1], b.mask_BT.shape[1])
    a, b = _left_pad(a, length), _left_pad(b, length)
    kv = [
        (torch.cat([ka, kb]), torch.cat([va, vb]))
        for (ka, va), (kb, vb) in zip(a.kv, b.kv, strict=True)
    ]
    return BatchState(kv=kv, mask_BT=torch.cat([a.mask_BT, b.mask_BT]))


def _left_pad(state: BatchState, length: int) -> BatchState:
    extra = length - state.mask_BT.shape[1]
    if extra == 0:
        return state
    pad = torch.nn.functional.pad
    kv = [(pad(k, (0, 0, extra, 0)), pad(v, (0, 0, extra, 0))) for k, v in state.kv]
    return BatchState(kv=kv, mask_BT=pad(state.mask_BT, (extra, 0)))


def select(state: BatchState, rows: list[int]) -> BatchState | None:
    """Keep ``rows`` (in that order) and drop padding columns no kept row needs."""
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.long, device=state.mask_BT.device)
    mask_BT = state.mask_BT.index_select(0, index)
    start = int((mask_BT.sum(dim=0) > 0).nonzero()[0])  # first column any row uses
    kv = [
        (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
        for k, v in state.kv
    ]
    return BatchState(kv=kv, mask_BT=mask_BT[:, start:])
