"""The training batch every backend consumes: sequences packed end to end.

Shapes (N = total tokens, B = sequences):
    tokens      [N] int64      prompt + response ids of every sequence, back to back
    cu_seqlens  [B + 1] int32  sequence boundaries
    per-token   [N] float32    loss_mask, advantages, old/ref/rollout log-probs, returns, values

Alignment ("prediction at position"): entry t of a per-token tensor describes the prediction
made at position t, i.e. of token t + 1 of the same sequence. It lines up with the model's
logits without any shift. The last position of every sequence predicts nothing and has
loss_mask 0; so do prompt positions.

``global_num_tokens`` / ``global_num_seqs`` are the loss denominators of the whole step
(all data-parallel ranks, all micro-batches); :meth:`select` keeps them, so every part's
loss is its share of the full-batch loss.
"""

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from rl_core.aggregation import segment_ids
from rl_core.packing import cu_seqlens_from_lengths
from rl_core.types import Sample

PER_TOKEN_FIELDS = (
    "loss_mask",
    "advantages",
    "old_log_probs",
    "ref_log_probs",
    "rollout_log_probs",
    "returns",
    "old_values",
)


@dataclass(kw_only=True)
class TrainBatch:
    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    global_num_tokens: float | None = None
    global_num_seqs: float | None = None

    def __post_init__(self):
        self._check_fields(int(self.cu_seqlens[-1]))

    def _check_fields(self, boundaries_end: int) -> None:
        """``boundaries_end`` (the last cu_seqlens entry, read where that is free) covers
        the tokens, and every per-token field has one value per token."""
        num_tokens = self.tokens.shape[0]
        if boundaries_end != num_tokens:
            raise ValueError(f"cu_seqlens ends at {boundaries_end}, tokens has {num_tokens}")
        for name in PER_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and value.shape != (num_tokens,):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected ({num_tokens},)")

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def seq_lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def with_global_denominators(self) -> "TrainBatch":
        """This batch as the whole step: its own valid tokens and sequences as denominators."""
        mask = self.loss_mask.float()
        seq_has_tokens = torch.zeros(self.num_seqs).index_add(
            0, segment_ids(self.cu_seqlens).cpu(), mask.cpu()
        )
        return replace(
            self,
            global_num_tokens=float(mask.sum()),
            global_num_seqs=float((seq_has_tokens > 0).sum()),
        )

    def select(self, seq_indices: Sequence[int]) -> "TrainBatch":
        """The sub-batch of the given sequences (in that order), keeping global denominators."""
        picked_seqs = torch.as_tensor(list(seq_indices), dtype=torch.long)
        bounds = self.cu_seqlens.to("cpu", torch.long)
        starts, lengths = bounds[:-1][picked_seqs], (bounds[1:] - bounds[:-1])[picked_seqs]
        new_bounds = cu_seqlens_from_lengths(lengths.tolist())
        # token t of the result is old token t + (old start - new start) of its sequence
        shift = torch.repeat_interleave(starts - new_bounds[:-1].long(), lengths)
        token_index = (torch.arange(int(lengths.sum())) + shift).to(self.tokens.device)
        picked = {
            name: None if getattr(self, name) is None else getattr(self, name)[token_index]
            for name in PER_TOKEN_FIELDS
        }
        return replace(
            self,
            tokens=self.tokens[token_index],
            cu_seqlens=new_bounds.to(self.cu_seqlens.device),
            **picked,
        )

    def to(self, device: torch.device | str) -> "TrainBatch":
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def next_token_targets(tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Target of every position: the next token of the same sequence, 0 at each sequence end.

    ``[N]`` -> ``[N]``; pair with a mask that is 0 at sequence ends. No value is read back
    from a GPU ``cu_seqlens``: an empty sequence's "end" is the previous sequence's end,
    or -1 for leading empty ones, which wraps to position N - 1, the last sequence's end.
    """
    targets = torch.roll(tokens, shifts=-1)
    if tokens.numel():
        targets[cu_seqlens[1:].long() - 1] = 0
    return targets


def batch_from_samples(
    samples: Sequence[Sample], advantages: Sequence[float | Sequence[float]] | None = None
) -> TrainBatch:
    """Pack samples into a :class:`TrainBatch` (global denominators set to this batch).

    ``advantages`` gives one scalar per sample (broadcast over its response) or one value
    per response token. Rollout log-probs are carried when every sample has them.
    """
    tokens, mask, adv, rollout = [], [], [], []
    has_rollout = all(s.rollout_log_probs is not None for s in samples)
    for i, sample in enumerate(samples):
        sample.validate()
        length, prompt_len = len(sample.tokens), sample.prompt_length
        if prompt_len < 1:
            raise ValueError(f"sample {sample.index}: needs at least one prompt token")
        response_mask = sample.effective_loss_mask()
        shifted = [0.0] * length
        shifted[prompt_len - 1 : length - 1] = [float(m) for m in response_mask]
        tokens.extend(sample.tokens)
        mask.extend(shifted)
        if advantages is not None:
            per_token = _response_values(advantages[i], sample.response_length)
            adv.extend(_place_response(per_token, prompt_len, length))
        if has_rollout:
            rollout.extend(_place_response(sample.rollout_log_probs, prompt_len, length))
    batch = TrainBatch(
        tokens=torch.tensor(tokens, dtype=torch.long),
        cu_seqlens=cu_seqlens_from_lengths([len(s.tokens) for s in samples]),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32) if advantages is not None else None,
        rollout_log_probs=torch.tensor(rollout, dtype=torch.float32) if has_rollout else None,
    )
    return batch.with_global_denominators()


def _response_values(value: float | Sequence[float], response_length: int) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * response_length
    if len(value) != response_length:
        raise ValueError(f"{len(value)} per-token advantages for {response_length} response tokens")
    return [float(v) for v in value]


def _place_response(values: Sequence[float], prompt_len: int, length: int) -> list[float]:
    """Response values moved to the positions that predict them (prompt_len - 1 ...)."""
    placed = [0.0] * length
    placed[prompt_len - 1 : length - 1] = list(values)
    return placed
