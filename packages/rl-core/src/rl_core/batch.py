"""The training batch every backend consumes: sequences packed end to end.

Shapes (N = total tokens, B = sequences):
    tokens      [N] int64      prompt + response ids of every sequence, back to back
    cu_seqlens  [B + 1] int32  sequence boundaries
    per-token   [N] float32    loss_mask, advantages, old/ref/rollout log-probs, returns, values
    routed_experts [N, L, K] int16  MoE only: the engine's experts of each token per layer
                               (rl_core.routing; -1 rows: the trainer's router chooses)

Alignment ("prediction at position"): entry t of a per-token tensor describes the prediction
made at position t, i.e. of token t + 1 of the same sequence. It lines up with the model's
logits without any shift. The last position of every sequence predicts nothing and has
loss_mask 0; so do prompt positions.

``global_num_tokens`` / ``global_num_seqs`` are the loss denominators of the whole step
(all data-parallel ranks, all micro-batches); :meth:`select` keeps them, so every part's
loss is its share of the full-batch loss.

A batch also keeps ``host_cu_seqlens``, a host copy of its boundaries that stays behind
when the batch moves to a GPU (:meth:`to`). Lengths, checks and :meth:`select` read it, so
splitting a GPU batch into micro-batches never waits for the device. A batch built with
other device boundaries (``dataclasses.replace(batch, cu_seqlens=...)``) reads them back
once instead. Treat ``cu_seqlens`` as immutable: the copy is not refreshed.
"""

import array
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from rl_core.packing import cu_seqlens_from_lengths
from rl_core.routing import packed_routes
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
    routed_experts: torch.Tensor | None = None  # [N, L, K]: routes of each token (input)
    global_num_tokens: float | None = None
    global_num_seqs: float | None = None
    # the host copy of cu_seqlens (module docstring); set by __post_init__, to and select
    host_bounds: "HostBounds | None" = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        cu = self.cu_seqlens
        if cu.device.type == "cpu":
            host = cu
        elif self.host_bounds is not None and self.host_bounds.of is cu:
            host = self.host_bounds.values
        else:
            host = cu.cpu()  # boundaries made on the device: read back once
        self.host_bounds = HostBounds(host, cu)
        self._check_fields(int(host[-1]))

    @property
    def host_cu_seqlens(self) -> torch.Tensor:
        """``cu_seqlens`` on the host (no read of the device)."""
        return self.host_bounds.values

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
        routes = self.routed_experts
        if routes is not None and (routes.dim() != 3 or routes.shape[0] != num_tokens):
            raise ValueError(
                f"routed_experts has shape {tuple(routes.shape)}, expected ({num_tokens}, L, K)"
            )

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def seq_lengths(self) -> list[int]:
        bounds = self.host_cu_seqlens.tolist()
        return [end - start for start, end in itertools.pairwise(bounds)]

    def with_global_denominators(self) -> "TrainBatch":
        """This batch as the whole step: its own valid tokens and sequences as denominators."""
        # valid tokens before each boundary, so a sequence's count is a difference
        before = torch.cumsum(self.loss_mask.detach().cpu().double(), 0)
        before = torch.cat([before.new_zeros(1), before])  # pad is ~100x slower on the CPU
        bounds = self.host_cu_seqlens.long()
        per_seq = before[bounds[1:]] - before[bounds[:-1]]
        return replace(
            self,
            global_num_tokens=float(before[-1]),
            global_num_seqs=float((per_seq > 0).sum()),
        )

    def select(self, seq_indices: Sequence[int]) -> "TrainBatch":
        """The sub-batch of the given sequences (in that order), keeping global denominators.
        On a GPU batch nothing is read back from the device: the token index is built on
        the host from ``host_cu_seqlens`` (vectorised) and copied asynchronously. All the
        sequences in their order are this batch itself: nothing is gathered or copied (a
        micro-batch holding the whole batch)."""
        seq_indices = list(seq_indices)
        if seq_indices == list(range(self.num_seqs)):
            return self
        host_index, new_bounds = _token_index(self.host_cu_seqlens, seq_indices)
        token_index = to_device(host_index, self.tokens.device)
        gathered = {
            name: None if getattr(self, name) is None else getattr(self, name)[token_index]
            for name in (*PER_TOKEN_FIELDS, "routed_experts")
        }
        cu_seqlens = to_device(new_bounds, self.cu_seqlens.device)
        return replace(
            self,
            tokens=self.tokens[token_index],
            cu_seqlens=cu_seqlens,
            host_bounds=HostBounds(new_bounds, cu_seqlens),
            **gathered,
        )

    def to(self, device: torch.device | str) -> "TrainBatch":
        """This batch on ``device``; host-to-GPU copies go through pinned memory and do not
        wait for the device (:func:`to_device`). ``host_cu_seqlens`` stays on the host."""
        moved = {
            f.name: to_device(getattr(self, f.name), device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        host_bounds = HostBounds(self.host_cu_seqlens, moved["cu_seqlens"])
        return replace(self, **moved, host_bounds=host_bounds)


@dataclass(frozen=True, eq=False)
class HostBounds:
    """``values``: a host copy of the boundaries tensor ``of`` (the batch's cu_seqlens).
    A batch trusts the copy only while ``of`` is its own cu_seqlens object."""

    values: torch.Tensor
    of: torch.Tensor


def _token_index(bounds: torch.Tensor, seq_indices: list[int]):
    """``(token index [N'], cu_seqlens [B' + 1])`` of the sequences ``seq_indices`` of a
    packed batch with boundaries ``bounds`` (host tensors), in that order."""
    picked = torch.tensor(seq_indices, dtype=torch.long)
    starts = bounds.long()[picked]
    lengths = bounds.long()[picked + 1] - starts
    new_bounds = cu_seqlens_from_lengths(lengths)
    # token t of the selection is start (of its sequence) + t - (its sequence's new start)
    shift = torch.repeat_interleave(starts - new_bounds[:-1].long(), lengths)
    return shift + torch.arange(shift.numel()), new_bounds


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor.to(device)``; from the host to a GPU through pinned memory, asynchronously
    (a copy from pageable memory would make the host wait for the device's queue)."""
    device = torch.device(device)
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def next_token_targets(tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Target of every position: the next token of the same sequence, 0 at each sequence end.

    ``[N]`` -> ``[N]``; pair with a mask that is 0 at sequence ends. No value is read back
    from a GPU ``cu_seqlens``: an empty sequence's "end" is the previous sequence's end,
    or -1 for leading empty ones, which wraps to position N - 1, the last sequence's end.
    """
    targets = torch.roll(tokens, shifts=-1)
    if tokens.numel():  # index_fill_ takes the 0 as a kernel argument (no host copy)
        targets.index_fill_(0, cu_seqlens[1:].long() - 1, 0)
    return targets


def batch_from_samples(
    samples: Sequence[Sample], advantages: Sequence[float | Sequence[float]] | None = None
) -> TrainBatch:
    """Pack samples into a :class:`TrainBatch` (global denominators set to this batch).

    ``advantages`` gives one scalar per sample (broadcast over its response) or one value
    per response token. Rollout log-probs are carried when every sample has them, and so
    are routed experts (rl_core.routing; some samples with them and some without is a
    ValueError: a trainer replaying routes would silently route those on its own).
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
        routed_experts=_routes(samples),
        tokens=_tensor(tokens, torch.long),
        cu_seqlens=cu_seqlens_from_lengths([len(s.tokens) for s in samples]),
        loss_mask=_tensor(mask, torch.float32),
        advantages=_tensor(adv, torch.float32) if advantages is not None else None,
        rollout_log_probs=_tensor(rollout, torch.float32) if has_rollout else None,
    )
    return batch.with_global_denominators()


_ARRAY_CODES = {torch.long: "q", torch.float32: "f"}


def _tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` for a flat list of Python numbers, through a
    stdlib array (a C loop, about 3.5x faster than torch.tensor's per-element checks for
    a step's ~40K tokens); the tensor shares the array's memory and keeps it alive."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype)


def _routes(samples: Sequence[Sample]) -> torch.Tensor | None:
    """Packed routes ``[N, L, K]`` when every sample has them, None when none has."""
    present = [s.routed_experts is not None for s in samples]
    if not any(present):
        return None
    if not all(present):
        missing = [s.index for s, has in zip(samples, present, strict=True) if not has]
        raise ValueError(
            f"samples {missing[:8]} have no routed_experts while others do; routing replay "
            "needs every sample's routes (the rollout must ask return_routed_experts)"
        )
    return packed_routes([s.routed_experts for s in samples], [len(s.tokens) for s in samples])


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
