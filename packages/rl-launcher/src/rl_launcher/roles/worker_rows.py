"""The token data of ``rollout.data_plane: workers``, kept where the rollout workers made it
(:mod:`rl_launcher.roles.rollout_workers`), and the rank batches built from it.

Each rollout worker puts every group it generated into Ray's object store as two objects:

    tokens     (ids int64 [N_g], bounds int64 [n + 1])   prompt + response ids of its samples
    log_probs  (values float32 [R_g], bounds int64 [n + 1])  the engine's response log-probs

and hands the driver a :class:`SampleRow` per sample: everything a sample carries but its
token lists (reward, status, lengths, weight versions, group and index, metadata), plus the
two objects' references and the sample's row in them. The driver groups, filters and takes
advantages over those as it does over samples; a step's batch for one data-parallel rank
is a :class:`RankRows`: references, rows and the small per-sequence values (lengths, loss
masks other than all ones, the advantages of each response token). The rank turns it into
its :class:`~rl_core.batch.TrainBatch` (:meth:`RankRows.to_train_batch`), fetching the
objects from the workers' nodes: the tokens never pass through the driver.

The trainer's old and reference log-probs of a RankRows stay on the rank that computed
them (:class:`HeldValues`: an object it put, by reference); the driver selects minibatches
from them without reading a value, and gets the log-prob gap metric as each rank's
scalars (:meth:`RankRows.hold`, :func:`held_gap`).

No torch or Ray at import: the simulated ranks (:mod:`rl_launcher.simulated.trainer`)
unpickle :class:`RankRows` without torch.
"""

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from rl_core.types import Sample, SampleStatus


@dataclass(kw_only=True)
class SampleRow(Sample):
    """A sample on the driver without its tokens (``tokens``, ``rollout_log_probs`` and the
    texts are empty): ``num_tokens`` (prompt + response) and where its ids and log-probs
    are (``tokens_ref``, ``log_probs_ref``: ObjectRefs of its group's objects, the second
    None without engine log-probs; ``row``: its position in them)."""

    num_tokens: int = 0
    tokens_ref: Any = None
    log_probs_ref: Any = None
    row: int = 0

    @property
    def prompt_length(self) -> int:
        return self.num_tokens - self.response_length


def group_objects(samples: list[Sample]) -> tuple[tuple, tuple | None]:
    """The two objects of a group (module docstring): its ids, and its engine log-probs
    when every sample that finished has them (aborted samples' rows are empty), else None."""
    import numpy as np

    lengths = [len(s.tokens) for s in samples]
    ids = np.fromiter((t for s in samples for t in s.tokens), dtype=np.int64, count=sum(lengths))
    tokens = (ids, np.cumsum([0, *lengths], dtype=np.int64))
    finished = [s.status is not SampleStatus.ABORTED for s in samples]
    if any(s.rollout_log_probs is None for s, done in zip(samples, finished, strict=True) if done):
        return tokens, None
    rows = [s.rollout_log_probs or [] for s in samples]
    values = np.array([v for row in rows for v in row], dtype=np.float32)
    return tokens, (values, np.cumsum([0, *map(len, rows)], dtype=np.int64))


def sample_row(sample: Sample, row: int, tokens_ref, log_probs_ref) -> SampleRow:
    """``sample`` without its token data (see :class:`SampleRow`)."""
    has_log_probs = log_probs_ref is not None and sample.rollout_log_probs is not None
    return SampleRow(
        response_length=sample.response_length,
        loss_mask=unless_all_ones(sample.loss_mask),
        reward=sample.reward,
        status=sample.status,
        weight_versions=list(sample.weight_versions),
        group_index=sample.group_index,
        index=sample.index,
        label=sample.label,
        metadata=sample.metadata,
        num_tokens=len(sample.tokens),
        tokens_ref=tokens_ref,
        log_probs_ref=log_probs_ref if has_log_probs else None,
        row=row,
    )


def unless_all_ones(loss_mask: list[int] | None) -> list[int] | None:
    """``loss_mask``, or None (every response token trains) when it is all ones, as the
    engines' responses' masks are: no per-token list reaches the driver, its advantages
    or the ranks' batches (at ~630 tokens a response such lists cost the driver ~0.08 ms
    a sample in the advantages alone: docs/scale.md)."""
    if loss_mask is not None and loss_mask.count(1) == len(loss_mask):
        return None
    return loss_mask


@dataclass(kw_only=True)
class RankRows:
    """One data-parallel rank's batch of a step, by reference (module docstring). Per
    sequence i: ``tokens_refs[i]`` / ``log_probs_refs[i]`` hold it at row ``rows[i]``;
    ``lengths[i]`` tokens, ``response_lengths[i]`` of them the response, ``loss_masks[i]``
    its response loss mask (None: all ones). ``advantages``: float32 ``[sum(response_lengths)]``,
    each response's values in turn. ``old_log_probs`` / ``ref_log_probs``: the trainer's
    :class:`HeldValues` (or ``[N]`` as in a TrainBatch). ``gap_seqs``: the sequences whose
    engine and trainer log-probs measure the same weights (the log-prob gap metric's; set
    by the driver before the old-policy pass, see :meth:`hold`). Offers what the loop asks of a
    TrainBatch on the driver (``num_seqs``, ``num_tokens``, :meth:`select`,
    :meth:`with_global_denominators`, ``loss_mask`` and ``rollout_log_probs`` for the
    log-prob gap metric, fetched then)."""

    tokens_refs: list
    log_probs_refs: list | None  # None: some sample of the step lacks engine log-probs
    rows: list[int]
    lengths: list[int]
    response_lengths: list[int]
    loss_masks: list
    advantages: Any = None
    old_log_probs: Any = None
    ref_log_probs: Any = None
    global_num_tokens: float = 0.0
    global_num_seqs: float = 0.0
    gap_seqs: list[int] | None = None
    _fetched: dict = field(default_factory=dict, repr=False, compare=False)

    def __getstate__(self) -> dict:
        """Tensors travel as numpy arrays (a rank without torch can read the batch)."""
        state = {k: v for k, v in self.__dict__.items() if k != "_fetched"}
        for name in ("advantages", "old_log_probs", "ref_log_probs"):
            value = state[name]
            if value is not None and hasattr(value, "numpy"):
                state[name] = value.detach().cpu().numpy()
        return state | {"_fetched": {}}

    @property
    def num_seqs(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def valid_tokens(self) -> list[float]:
        """Each sequence's count of trained tokens (its loss mask's sum)."""
        return [
            float(n if mask is None else sum(mask))
            for n, mask in zip(self.response_lengths, self.loss_masks, strict=True)
        ]

    def with_global_denominators(self) -> "RankRows":
        valid = self.valid_tokens()
        return replace(
            self,
            global_num_tokens=float(sum(valid)),
            global_num_seqs=float(sum(v > 0 for v in valid)),
        )

    def select(self, seq_indices) -> "RankRows":
        """The sub-batch of the given sequences, in that order (denominators kept)."""
        picked = list(seq_indices)

        def pick(values):
            return None if values is None else [values[i] for i in picked]

        return replace(
            self,
            tokens_refs=pick(self.tokens_refs),
            log_probs_refs=pick(self.log_probs_refs),
            rows=pick(self.rows),
            lengths=pick(self.lengths),
            response_lengths=pick(self.response_lengths),
            loss_masks=pick(self.loss_masks),
            advantages=_gather(self.advantages, self.response_lengths, picked),
            gap_seqs=None,  # measured on the whole batch
            old_log_probs=_gather(self.old_log_probs, self.lengths, picked),
            ref_log_probs=_gather(self.ref_log_probs, self.lengths, picked),
            _fetched={},
        )

    def fetch(self, ids: bool = True) -> tuple[list | None, list | None]:
        """Each sequence's ids (int64; None unless ``ids``) and engine log-probs (float32
        response values, or None for the batch), read from the object store in one call
        (zero-copy where local)."""
        import ray

        wanted = [self.tokens_refs if ids else None, self.log_probs_refs]
        refs = [ref for refs in wanted if refs is not None for ref in refs]
        unique = list(dict.fromkeys(refs))
        objects = dict(zip(unique, ray.get(unique), strict=True))
        return tuple(
            None
            if refs is None
            else [_row(objects[ref], r) for ref, r in zip(refs, self.rows, strict=True)]
            for refs in wanted
        )

    def placed(self, rows) -> Any:
        """float32 ``[N]``: each sequence's response values (``rows[i]``) at the positions
        that predict them (prompt length - 1 on), 0 elsewhere; as batch_from_samples."""
        import numpy as np

        out = np.zeros(self.num_tokens, dtype=np.float32)
        offset = 0
        for length, response, values in zip(self.lengths, self.response_lengths, rows, strict=True):
            start = offset + length - response - 1
            out[start : start + response] = values
            offset += length
        return out

    def mask_rows(self) -> list:
        """Each response's loss mask for :meth:`placed` (1.0 fills a response: no list)."""
        return [1.0 if mask is None else mask for mask in self.loss_masks]

    def advantage_rows(self) -> list:
        import numpy as np

        bounds = np.cumsum([0, *self.response_lengths])
        return [self.advantages[a:b] for a, b in itertools.pairwise(bounds)]

    @property
    def loss_mask(self):
        """``[N]`` float32 loss mask (from the lengths; no fetch)."""
        import torch

        return torch.from_numpy(self.placed(self.mask_rows()))

    @property
    def rollout_log_probs(self):
        """``[N]`` engine log-probs, fetched from the workers (None without them)."""
        import torch

        if self.log_probs_refs is None:
            return None
        if "rollout" not in self._fetched:  # the log-probs' objects only, not the ids'
            _, log_probs = self.fetch(ids=False)
            self._fetched["rollout"] = torch.from_numpy(self.placed(log_probs))
        return self._fetched["rollout"]

    def to_train_batch(self):
        """The rank's :class:`~rl_core.batch.TrainBatch`, the same as the driver's data plane
        builds (``batch_from_samples`` over the step, then ``select``)."""
        import numpy as np
        import torch

        from rl_core.batch import TrainBatch
        from rl_core.packing import cu_seqlens_from_lengths

        ids, log_probs = self.fetch()
        tokens = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        assert len(tokens) == self.num_tokens, (len(tokens), self.num_tokens)

        def tensor(values):
            return None if values is None else torch.as_tensor(values, dtype=torch.float32)

        return TrainBatch(
            tokens=torch.from_numpy(tokens),
            cu_seqlens=cu_seqlens_from_lengths(self.lengths),
            loss_mask=torch.from_numpy(self.placed(self.mask_rows())),
            advantages=None
            if self.advantages is None
            else torch.from_numpy(self.placed(self.advantage_rows())),
            rollout_log_probs=None
            if log_probs is None
            else torch.from_numpy(self.placed(log_probs)),
            old_log_probs=tensor(_read(self.old_log_probs)),
            ref_log_probs=tensor(_read(self.ref_log_probs)),
            global_num_tokens=self.global_num_tokens,
            global_num_seqs=self.global_num_seqs,
        )

    def hold(self, values, gap: tuple[float, int, float] | None = None) -> "HeldValues":
        """The rank's ``[N]`` float32 ``values`` of this batch (a numpy array) put into the
        object store by the rank (it owns them), with its log-prob ``gap`` (see
        :func:`log_prob_gap`): what the rank's log-prob pass hands the driver."""
        import ray

        return HeldValues(ref=ray.put(values), lengths=list(self.lengths), picked=None, gap=gap)


@dataclass
class HeldValues:
    """Per-token values of a rank's batch (old or reference log-probs), kept in the object
    store by the rank that computed them: ``ref`` (an ObjectRef of its ``[N]`` float32
    array), ``lengths`` (the tokens of each sequence of the batch they were computed for)
    and ``picked`` (the sequences of that batch these are, in order; None: all). ``gap``:
    the rank's log-prob gap on its ``gap_seqs`` (:func:`log_prob_gap`), None for the
    reference's. The driver selects from it without reading a value."""

    ref: Any
    lengths: list[int]
    picked: list[int] | None
    gap: tuple[float, int, float] | None = None

    def select(self, picked: list[int]) -> "HeldValues":
        whole = self.picked
        chosen = list(picked) if whole is None else [whole[i] for i in picked]
        return replace(self, picked=chosen, gap=None)

    def read(self):
        """The values (numpy), the picked sequences' in turn: read where the rank is."""
        import ray

        values = ray.get(self.ref)
        if self.picked is None:
            return values
        return _gather(values, self.lengths, self.picked)


def log_prob_gap(batch, log_probs, seqs: list[int] | None) -> tuple[float, int, float] | None:
    """``|log_probs - batch.rollout_log_probs|`` over the loss tokens of sequences ``seqs``
    of ``batch`` (a TrainBatch; None: no sequence): its mean, count and max, computed as
    :func:`rl_launcher.loops.step_metrics.mismatch` computes them over the driver's
    batches. None without engine log-probs or a sequence to measure."""
    import torch

    if not seqs or batch.rollout_log_probs is None:
        return None
    lengths = batch.cu_seqlens.diff().long()
    chosen = torch.zeros(len(lengths), dtype=torch.bool)
    chosen[torch.as_tensor(seqs)] = True
    keep = chosen.repeat_interleave(lengths) & (batch.loss_mask > 0)
    diff = (log_probs - batch.rollout_log_probs).abs()[keep]
    if not len(diff):
        return None
    return float(diff.mean()), len(diff), float(diff.max())


def held_gap(rank_batches: list) -> dict[str, float]:
    """The log-prob gap metric (``mismatch/logprob_abs_diff_mean`` and ``_max``) from each
    rank's scalars: the mean weighted by the tokens each measured."""
    gaps = [
        b.old_log_probs.gap
        for b in rank_batches
        if isinstance(b.old_log_probs, HeldValues) and b.old_log_probs.gap is not None
    ]
    if not gaps:
        return {}
    tokens = sum(count for _, count, _ in gaps)
    return {
        "mismatch/logprob_abs_diff_mean": sum(mean * count for mean, count, _ in gaps) / tokens,
        "mismatch/logprob_abs_diff_max": max(top for *_, top in gaps),
    }


def as_train_batch(batch):
    """A rank's batch as a TrainBatch: a :class:`RankRows` is assembled, others pass."""
    return batch.to_train_batch() if isinstance(batch, RankRows) else batch


def _read(values):
    """Held values read (on the rank), others as they are."""
    return values.read() if isinstance(values, HeldValues) else values


def _row(group_object: tuple, row: int):
    values, bounds = group_object
    return values[bounds[row] : bounds[row + 1]]


def _gather(values, lengths: list[int], picked: list[int]):
    """The pieces of ``values`` (``lengths[i]`` values for piece i, back to back) of the
    ``picked`` pieces, in that order; None stays None."""
    if values is None:
        return None
    if isinstance(values, HeldValues):  # still where the rank put them
        return values.select(picked)
    import numpy as np

    bounds = np.cumsum([0, *lengths])
    pieces = [values[bounds[i] : bounds[i + 1]] for i in picked]
    if hasattr(values, "numpy"):  # a torch tensor
        import torch

        return torch.cat(pieces) if pieces else values[:0]
    return np.concatenate(pieces) if pieces else values[:0]
