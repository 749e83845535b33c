"""The data buffer: scored samples in, per-rank training batches of one step out.

Samples arrive in any order; the buffer groups them by prompt (``Sample.group_index``),
and once a group is complete (``group_size`` samples, or a whole group a rollout returned:
:meth:`DataBuffer.add_groups`, whose size may differ, e.g. forked agent episodes) it drops
it when a sample was aborted by the engine or when the dynamic-sampling filter (rl_core
``GROUP_FILTERS``, by name) rejects its rewards. A sample whose reward failed (skipped
under ``rollout.on_reward_error=skip``: aborted, with ``metadata["reward_error"]``) leaves
only itself: the group goes on with the samples that
scored, its advantages taken over them, unless fewer than two are left (one for groups of
one); then it is dropped and counted (``rollout/groups_dropped_reward_error``). A step
takes the oldest ready groups, computes advantages with the named estimator
(rl_core ``ADVANTAGE_ESTIMATORS``), packs every sample into one :class:`TrainBatch` (so
the loss denominators cover the whole step) and splits it across ranks with near-equal
token counts (``balanced_partitions``).

With a KL-shaped reward (``reward_kl_coef`` > 0) the advantages need the step's old and
reference log-probs, which the trainer computes from the rank batches: ``pop_step`` then
leaves ``advantages`` empty and :meth:`DataBuffer.fill_advantages` fills them once the
log-probs exist. Without it nothing waits: ``pop_step`` computes them as before.

On-policy distillation (``opd_coef`` > 0, the launcher's ``distill.coef``) shapes the
estimator's advantages per response token with the teacher's log-probs that each sample
carries in ``metadata[TEACHER_KEY]`` (rl_core ``opd_advantages``, against the engine's
rollout log-probs), and adds ``opd/reverse_kl`` to the step's metrics. Whitening, when on
(``whiten``, or the estimator's default), comes after the teacher's term, as in slime.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from rl_core.advantages import ADVANTAGE_ESTIMATORS, WHITENED_BY_DEFAULT, AdvantageInputs
from rl_core.batch import TrainBatch, batch_from_samples
from rl_core.distill import opd_advantages
from rl_core.filters import GROUP_FILTERS
from rl_core.kl import approx_kl
from rl_core.metrics import summarize
from rl_core.packing import balanced_partitions
from rl_core.types import Sample, SampleStatus, scalar_reward

TEACHER_KEY = "teacher_log_probs"  # Sample.metadata: the teacher's log-prob of each response token


@dataclass(kw_only=True)
class StepBatch:
    """One training step: ``rank_batches[r]`` holds ``samples[i]`` for i in ``partitions[r]``."""

    samples: list[Sample]
    rank_batches: list[TrainBatch]
    partitions: list[list[int]]
    metrics: dict[str, float] = field(default_factory=dict)
    group_sizes: list[int] = field(default_factory=list)  # of the contiguous groups in samples


def split_by_rank(
    batch: TrainBatch, samples: list[Sample], num_ranks: int
) -> tuple[list[list[int]], list[TrainBatch]]:
    """``batch`` (of ``samples``, with step-wide denominators) split across ``num_ranks``
    data-parallel ranks, balanced by tokens: each rank's sample indices and its batch (the
    whole batch where a rank has every sample)."""
    everything = list(range(len(samples)))
    partitions = (
        [everything]  # what balanced_partitions gives for one rank, without its heap
        if num_ranks == 1
        else balanced_partitions([len(s.tokens) for s in samples], num_ranks)
    )
    return partitions, [batch if part == everything else batch.select(part) for part in partitions]


class DataBuffer:
    """Groups, filters and batches samples (see the module docstring)."""

    def __init__(
        self,
        *,
        group_size: int,
        num_ranks: int,
        advantage_estimator: str = "grpo",
        group_filter: str = "keep_all",
        reward_key: str | None = None,
        gamma: float = 1.0,
        lam: float = 1.0,
        reward_kl_coef: float = 0.0,
        reward_kl_kind: str = "k1",
        opd_coef: float = 0.0,
        whiten: bool | None = None,
    ):
        self._estimator = ADVANTAGE_ESTIMATORS.get(advantage_estimator)
        self._filter = GROUP_FILTERS.get(group_filter)
        self.group_size, self.num_ranks, self.reward_key = group_size, num_ranks, reward_key
        self.gamma, self.lam = gamma, lam
        self.reward_kl_coef, self.reward_kl_kind = reward_kl_coef, reward_kl_kind
        self.opd_coef = opd_coef
        self.whiten = whiten  # algorithm.normalize_advantages (None: the estimator's choice)
        self.whitens = advantage_estimator in WHITENED_BY_DEFAULT if whiten is None else whiten
        self._pending: dict[int, list[Sample]] = {}
        self._ready: list[list[Sample]] = []
        self._counts = {"groups_filtered": 0, "groups_aborted": 0, "groups_dropped_reward_error": 0}
        self._rewards_seen: list[float] = []

    @classmethod
    def from_config(cls, config, *, num_ranks: int, **extra) -> "DataBuffer":
        """The buffer of ``config``; ``extra`` goes to a subclass (a critic's ``value_fn``)."""
        algorithm = config.algorithm
        return cls(
            group_size=config.rollout.group_size,
            num_ranks=num_ranks,
            advantage_estimator=algorithm.advantage_estimator,
            group_filter=algorithm.group_filter,
            reward_key=algorithm.reward_key,
            gamma=algorithm.gamma,
            lam=algorithm.lam,
            reward_kl_coef=algorithm.reward_kl_coef,
            reward_kl_kind=algorithm.reward_kl_kind,
            opd_coef=config.distill.coef,
            whiten=algorithm.normalize_advantages,
            **extra,
        )

    @property
    def defers_advantages(self) -> bool:
        """True when advantages wait for the step's log-probs (:meth:`fill_advantages`)."""
        return self.reward_kl_coef > 0

    @property
    def num_ready_groups(self) -> int:
        return len(self._ready)

    def add(self, samples: Iterable[Sample]) -> None:
        for sample in samples:
            if sample.group_index is None:
                raise ValueError("a sample without group_index cannot be grouped by prompt")
            group = self._pending.setdefault(sample.group_index, [])
            group.append(sample)
            if len(group) == self.group_size:
                self._complete(self._pending.pop(sample.group_index))

    def add_groups(self, groups: Iterable[list[Sample]]) -> None:
        """Groups whole, as a rollout returns them, whatever their size: an agent episode
        whose history forked is one sample per leaf of its trajectory tree, so a prompt's
        group can hold more than ``group_size`` samples (or fewer). Advantages are taken
        over the group as it came (the estimators' ragged path)."""
        for group in groups:
            draws = {sample.group_index for sample in group}
            if len(draws) != 1 or None in draws:
                raise ValueError(
                    f"a rollout group holds group_index {sorted(draws, key=str)}: a custom "
                    "rollout must return one prompt per group, every sample numbered by it"
                )
            self._complete(list(group))

    def _complete(self, group: list[Sample]) -> None:
        group.sort(key=lambda s: (s.index is None, s.index))
        scored = [s for s in group if not reward_failed(s)]
        if any(s.status == SampleStatus.ABORTED for s in scored):  # by the engine: left out
            self._counts["groups_aborted"] += 1
            return
        if len(scored) < min(2, len(group)):  # no sample left to compare with
            self._counts["groups_dropped_reward_error"] += 1
            return
        rewards = [scalar_reward(s, self.reward_key) for s in scored]
        self._rewards_seen.extend(rewards)
        if self._filter(rewards):
            self._ready.append(scored)
        else:
            self._counts["groups_filtered"] += 1

    def pop_step(self, num_groups: int) -> StepBatch:
        """The next step made of the ``num_groups`` oldest ready groups; its batches have
        no advantages yet when :attr:`defers_advantages` (see :meth:`fill_advantages`)."""
        if num_groups > len(self._ready):
            raise ValueError(f"asked for {num_groups} groups, {len(self._ready)} are ready")
        groups, self._ready = self._ready[:num_groups], self._ready[num_groups:]
        samples = [s for group in groups for s in group]
        sizes = [len(group) for group in groups]
        advantages, distill_metrics = None, {}
        if not self.defers_advantages:
            advantages, distill_metrics = self.shaped_advantages(samples, group_sizes=sizes)
        full = batch_from_samples(samples, advantages)
        partitions, rank_batches = split_by_rank(full, samples, self.num_ranks)
        step = StepBatch(
            samples=samples,
            rank_batches=rank_batches,
            partitions=partitions,
            metrics=self._step_metrics(samples) | distill_metrics,
            group_sizes=sizes,
        )
        if not self.defers_advantages:
            step.rank_batches = self._with_targets(step, step.rank_batches)
        return step

    def fill_advantages(
        self, step: StepBatch, rank_batches: list[TrainBatch], ref_log_probs: list[torch.Tensor]
    ) -> list[TrainBatch]:
        """``rank_batches`` (``step``'s, with ``old_log_probs``) with the advantages that
        :meth:`pop_step` left for the KL-shaped reward: the per-token KL estimate
        (``reward_kl_kind``) of the old log-probs against ``ref_log_probs`` (``[N]`` per
        rank batch) goes to the estimator with ``kl_coef = reward_kl_coef``. Adds the
        step's mean KL over trained response tokens (``algorithm/reward_kl_mean``)."""
        assert self.defers_advantages, "pop_step already filled the advantages"
        per_rank = [
            approx_kl(b.old_log_probs, ref, kind=self.reward_kl_kind)
            for b, ref in zip(rank_batches, ref_log_probs, strict=True)
        ]
        kl = response_rows(step.samples, step.partitions, per_rank)
        mask = response_mask(step.samples)
        step.metrics["algorithm/reward_kl_mean"] = float((kl * mask).sum() / mask.sum().clamp(1))
        rows, distill_metrics = self.shaped_advantages(
            step.samples, kl=kl, group_sizes=step.group_sizes
        )
        step.metrics |= distill_metrics
        rank_batches = [
            replace(b, advantages=packed(step.samples, rows, part))
            for b, part in zip(rank_batches, step.partitions, strict=True)
        ]
        return self._with_targets(step, rank_batches)

    def _with_targets(self, step: StepBatch, rank_batches: list[TrainBatch]) -> list[TrainBatch]:
        """What else the step's rank batches need once advantages exist (a critic's)."""
        return rank_batches

    def shaped_advantages(
        self, samples: list[Sample], kl=None, group_sizes=None
    ) -> tuple[list[list[float]], dict[str, float]]:
        """:meth:`advantages`, then the teacher's per-token penalty when ``opd_coef`` > 0
        (:func:`distilled`); returns the rows and the distillation metrics (none when off)."""
        if self.opd_coef == 0:
            return self.advantages(samples, kl=kl, group_sizes=group_sizes), {}
        # unwhitened: the teacher's term is added first, then the sum whitened (as slime)
        rows = self.advantages(samples, kl=kl, group_sizes=group_sizes, whiten=False)
        return distilled(samples, rows, self.opd_coef, whiten=self.whitens)

    def advantages(
        self,
        samples: list[Sample],
        kl: torch.Tensor | None = None,
        group_sizes: list[int] | None = None,
        whiten: bool | None = None,
    ) -> list[list[float]]:
        """Per-response-token advantages of contiguous groups (of ``group_sizes`` samples
        each; None: all complete); ``kl`` ``[B, T]``: the per-token KL to the reference that
        the reward pays ``reward_kl_coef`` times; ``whiten`` overrides ``self.whiten``."""
        rewards = torch.tensor([scalar_reward(s, self.reward_key) for s in samples])
        inputs = AdvantageInputs(
            rewards=rewards,
            mask=response_mask(samples),
            group_size=self.group_size,
            group_sizes=self.ragged(group_sizes),
            gamma=self.gamma,
            lam=self.lam,
            kl=kl,
            kl_coef=self.reward_kl_coef,
            whiten=self.whiten if whiten is None else whiten,
        )
        per_token, _ = self._estimator(inputs)
        return [
            row[: s.response_length] for row, s in zip(per_token.tolist(), samples, strict=True)
        ]

    def ragged(self, group_sizes: list[int] | None) -> tuple[int, ...] | None:
        """``group_sizes`` for the estimator when some group is not complete, else None
        (the uniform path, unchanged for runs where every reward scored)."""
        if group_sizes is None or all(n == self.group_size for n in group_sizes):
            return None
        return tuple(group_sizes)

    def _step_metrics(self, samples: list[Sample]) -> dict[str, float]:
        metrics = summarize(self._rewards_seen, "rollout/reward")
        metrics |= summarize([s.response_length for s in samples], "rollout/response_length")
        metrics["rollout/truncated_frac"] = sum(
            s.status == SampleStatus.TRUNCATED for s in samples
        ) / max(len(samples), 1)
        self._rewards_seen = []
        return metrics | self.take_counts()

    def take_counts(self) -> dict[str, float]:
        """Groups dropped since the last call, as metrics: ``buffer/groups_filtered``,
        ``buffer/groups_aborted`` (an engine's error) and
        ``rollout/groups_dropped_reward_error`` (too few samples scored)."""
        counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        dropped = float(counts.pop("groups_dropped_reward_error"))
        return {f"buffer/{name}": float(n) for name, n in counts.items()} | {
            "rollout/groups_dropped_reward_error": dropped
        }


def reward_failed(sample: Sample) -> bool:
    """The sample's reward failed and was skipped (``rollout.on_reward_error=skip``)."""
    return sample.status == SampleStatus.ABORTED and bool(sample.metadata.get("reward_error"))


def response_mask(samples: list[Sample]) -> torch.Tensor:
    """``[B, T]`` loss mask of each sample's response tokens (0 past its end)."""
    width = max((s.response_length for s in samples), default=0)
    rows = [s.effective_loss_mask() for s in samples]  # one tensor, not one per sample
    mask = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.float32)
    return mask.reshape(len(samples), width)


def distilled(
    samples: list[Sample], rows: list[list[float]], coef: float, *, whiten: bool = False
) -> tuple[list[list[float]], dict[str, float]]:
    """``rows`` (per-response-token advantages) minus ``coef`` x (rollout - teacher)
    log-prob of each token the loss trains (rl_core ``opd_advantages``), whitened over the
    step's trained tokens when ``whiten``, and its metrics."""
    for sample in samples:
        if sample.rollout_log_probs is None or TEACHER_KEY not in sample.metadata:
            raise ValueError(
                f"sample {sample.group_index}/{sample.index} lacks rollout log-probs or the "
                f"teacher's ({TEACHER_KEY}): distillation needs both (engine rollouts and "
                "distill.teacher_url / teacher_path give them)"
            )
    shaped, metrics = opd_advantages(
        padded_rows(rows),
        padded_rows([s.rollout_log_probs for s in samples]),
        padded_rows([s.metadata[TEACHER_KEY] for s in samples]),
        response_mask(samples),
        coef=coef,
        whiten=whiten,
    )
    trimmed = [row[: s.response_length] for row, s in zip(shaped.tolist(), samples, strict=True)]
    return trimmed, metrics


def padded_rows(rows: list[list[float]]) -> torch.Tensor:
    """``[B, T]`` float32 of per-response-token lists, 0 past each one's end."""
    width = max((len(row) for row in rows), default=0)
    padded = [[*row, *[0.0] * (width - len(row))] for row in rows]
    return torch.tensor(padded, dtype=torch.float32).reshape(len(rows), width)


def response_rows(
    samples: list[Sample], partitions: list[list[int]], per_rank: list[torch.Tensor]
) -> torch.Tensor:
    """Packed per-token values of each rank batch (``per_rank[r]`` ``[N_r]``, holding
    ``samples[i]`` for i in ``partitions[r]``) as ``[B, T]`` rows of response tokens, 0 past
    a response's end. Response token j of a sample with prompt length P sits at position
    P - 1 + j of its sequence (TrainBatch's prediction-at-position alignment)."""
    width = max((s.response_length for s in samples), default=0)
    rows = torch.zeros(len(samples), width)
    for part, values in zip(partitions, per_rank, strict=True):
        offset = 0
        for i in part:
            sample = samples[i]
            start = offset + sample.prompt_length - 1
            rows[i, : sample.response_length] = values[start : start + sample.response_length]
            offset += len(sample.tokens)
    return rows


def placed(samples: list[Sample], rows) -> list[torch.Tensor]:
    """Per-sample ``[len(tokens)]`` tensors with ``rows[i]`` (response values) at the
    positions that predict them; the inverse of :func:`response_rows`."""
    out = []
    for sample, row in zip(samples, rows, strict=True):
        full = torch.zeros(len(sample.tokens))
        start = sample.prompt_length - 1
        full[start : start + len(row)] = torch.as_tensor(row, dtype=torch.float32)
        out.append(full)
    return out


def packed(samples: list[Sample], rows, part: list[int]) -> torch.Tensor:
    """``[N]`` values of the rank batch holding ``samples[i]`` for i in ``part``."""
    chosen = [samples[i] for i in part]
    return torch.cat(placed(chosen, [rows[i] for i in part])) if part else torch.zeros(0)
