"""The metrics an RL step adds about itself: why it trained nothing, where its time went (overhead, throughput,
colocated turn times), how stale its samples are, and how far the engines' log-probs are
from the trainer's on the same weights."""

from dataclasses import replace

import torch

from rl_core.types import SampleStatus
from rl_launcher.infra import faults
from rl_launcher.roles.worker_rows import RankRows, held_gap
from rl_launcher.session.run import Run


def empty_step(groups: list, config) -> dict:
    """A step that trains nothing: why (said in the progress line, counted by the fault
    rules) and how many of its samples failed."""
    cause = faults.empty_cause(groups, config)
    failed = sum(s.status is SampleStatus.ABORTED for group in groups for s in group)
    return {
        "buffer/empty_step": 1.0,
        faults.TRAINED_KEY: 0.0,
        faults.EMPTY_CAUSE_KEY: cause,
        faults.EMPTY_FAILED_KEY: float(failed),
    }


def turn_times(run: Run) -> dict[str, float]:
    """Colocated GPUs: the step's engine release/resume and trainer offload/onload times
    (:meth:`rl_launcher.infra.colocation.Turns.take_times`); nothing otherwise."""
    turns = run.trainer.turns
    return turns.take_times() if turns is not None else {}


def trained_tokens(parts: list[list]) -> int:
    return sum(batch.num_tokens for part in parts for batch in part)


def split_step(times: dict[str, float], metrics: dict, tokens: int) -> dict[str, float]:
    """``times`` plus the step's overhead and the training throughput in the loop.

    Overhead (``time/overhead``, ``time/overhead_frac``): the step's wall time outside the
    rollout (the rollout phase, and in the overlapping loops the wait for it to end) and
    outside the trainer's own log-prob and training compute (``time/*_compute``, measured
    in the workers): orchestration, data movement, offload/onload, weight sync and idle.
    Colocated, the hand-over to the engines before a rollout (trainer offload, engine
    resume: ``time/turns/in_rollout``) counts as overhead, not as rollout. Also the
    overhead without the weight sync (``time/overhead_excl_sync``, ``..._frac``).
    Throughput: trained tokens per second of the backend's compute
    (``perf/train_tokens_per_s``) and of the train phase's wall time
    (``perf/train_tokens_per_s_wall``, Ray calls and data transfer included)."""
    step = times["time/step"]
    compute = metrics.get("time/log_probs_compute", 0.0) + metrics.get("time/train_compute", 0.0)
    rollout = times.get("time/rollout", 0.0) + times.get("time/rollout_wait", 0.0)
    rollout -= metrics.get("time/turns/in_rollout", 0.0)
    overhead = max(step - rollout - compute, 0.0)
    no_sync = max(overhead - times.get("time/sync", 0.0), 0.0)
    out = times | {"time/overhead": overhead, "time/overhead_frac": overhead / step}
    out |= {"time/overhead_excl_sync": no_sync, "time/overhead_excl_sync_frac": no_sync / step}
    if metrics.get("time/train_compute") and times.get("time/train"):
        out["perf/train_tokens_per_s"] = tokens / metrics["time/train_compute"]
        out["perf/train_tokens_per_s_wall"] = tokens / times["time/train"]
    return out


def sample_version(sample, default: int) -> int:
    """The oldest weight version that produced a token of ``sample``."""
    versions = [int(v) for v in set(sample.weight_versions) if v.lstrip("-").isdigit()]
    return min(versions, default=default)


def staleness(batch, *, trainer_version: int) -> dict[str, float]:
    """How many weight versions the step's samples lag the trainer's weights."""
    lags = [trainer_version - sample_version(s, trainer_version) for s in batch.samples]
    versions = [sample_version(s, -1) for s in batch.samples]
    resumed = sum(1 for s in batch.samples if s.metadata.get("resumed"))
    return {
        "rollout/weight_version_min": float(min(versions, default=-1)),
        "rollout/staleness_max": float(max(lags, default=0)),
        "rollout/staleness_mean": sum(lags) / max(len(lags), 1),
        "rollout/resumed_samples": float(resumed),
    }


def fresh_only(rank_batches, batch, *, trainer_version: int) -> list:
    """Each rank's sequences generated entirely with the trainer's current weights: only
    there do engine and trainer log-probs measure the same policy. A rank whose sequences
    are all fresh (every rank, in the synchronous loop) is its batch itself: copying every
    token of the step for a metric was the driver's largest per-token cost (docs/scale.md)."""
    fresh = fresh_seqs(batch, trainer_version=trainer_version)
    return [
        b if len(keep) == b.num_seqs else b.select(keep)
        for b, keep in zip(rank_batches, fresh, strict=True)
        if keep
    ]


def fresh_seqs(batch, *, trainer_version: int) -> list[list[int]]:
    """Per rank, the sequences of its batch generated entirely with the trainer's current
    weights (see :func:`fresh_only`)."""
    current = {str(trainer_version)}
    return [
        [j for j, i in enumerate(part) if set(batch.samples[i].weight_versions) <= current]
        for part in batch.partitions
    ]


def with_gap_seqs(batch, *, trainer_version: int) -> list:
    """The step's rank batches; RankRows (``rollout.data_plane: workers``) told which
    sequences their rank measures the log-prob gap on (:func:`fresh_seqs`), so the rank
    measures it where the log-probs are and hands back scalars."""
    if not any(isinstance(b, RankRows) for b in batch.rank_batches):
        return batch.rank_batches
    fresh = fresh_seqs(batch, trainer_version=trainer_version)
    return [replace(b, gap_seqs=f) for b, f in zip(batch.rank_batches, fresh, strict=True)]


def log_prob_gap(rank_batches, batch, *, trainer_version: int) -> dict[str, float]:
    """The step's log-prob gap metric (:func:`mismatch` over the fresh sequences): from
    the ranks' scalars when they hold the log-probs (``data_plane: workers``), else from
    the batches on the driver."""
    if any(isinstance(b, RankRows) for b in rank_batches):
        return held_gap(rank_batches)
    return mismatch(fresh_only(rank_batches, batch, trainer_version=trainer_version))


def mismatch(rank_batches) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's on the same weights (with
    ``algorithm.old_log_probs: train_step`` the train step reports the mean itself)."""
    diffs = [
        (b.old_log_probs - b.rollout_log_probs).abs()[b.loss_mask > 0]
        for b in rank_batches
        if b.rollout_log_probs is not None and b.old_log_probs is not None
    ]
    if not diffs:
        return {}
    diff = torch.cat(diffs)
    return {
        "mismatch/logprob_abs_diff_mean": float(diff.mean()),
        "mismatch/logprob_abs_diff_max": float(diff.max()),
    }
