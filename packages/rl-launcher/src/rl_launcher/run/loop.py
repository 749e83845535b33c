"""The synchronous GRPO / PPO-style loop; every step reads like the algorithm:

    rollout (engines)  ->  buffer (groups, filter, advantages, per-rank batches)
    ->  old log-probs (trainer)  ->  train step  ->  weight sync (engines at version = step)

``train(config)`` sets everything up (model directory, data, Ray, training actor group,
engines and router), optionally resumes from the newest complete checkpoint, runs
``num_steps`` steps writing ``metrics.jsonl`` and a progress line per step, checkpoints
every ``checkpoint.interval`` steps and at the end, and draws the charts.
"""

import contextlib
import time
from dataclasses import replace
from pathlib import Path

import torch

from rl_launcher.buffer import DataBuffer
from rl_launcher.run import checkpoints
from rl_launcher.run.setup import Run, start_run
from rl_launcher.run.train_group import with_old_log_probs
from rl_launcher.run_log import format_progress, truncate_metrics


def train(config) -> Path:
    """Run ``config`` to its last step; returns the run directory."""
    with contextlib.closing(start_run(config)) as run:
        first = resume(run) + 1 if config.checkpoint.resume else 1
        buffer = DataBuffer.from_config(config, num_ranks=run.num_ranks)
        for step in range(first, config.num_steps + 1):
            metrics = run_step(run, buffer, step)
            run.metrics_log.append(step, metrics)
            if config.logging.progress:
                print(format_progress(step, config.num_steps, metrics), flush=True)
            interval = config.checkpoint.interval
            if (interval and step % interval == 0) or step == config.num_steps:
                save(run, step)
    _plot(Path(config.logging.run_dir))
    return Path(config.logging.run_dir)


def run_step(run: Run, buffer: DataBuffer, step: int) -> dict[str, float]:
    config, clock = run.config, Clock()
    groups, metrics = run.rollout.rollout(config.rollout.batch_size)
    buffer.add(s for group in groups for s in group)
    clock.lap("rollout")
    if buffer.num_ready_groups == 0:  # every group filtered: nothing to learn from this step
        return metrics | {"buffer/empty_step": 1.0} | clock.times()
    batch = buffer.pop_step(buffer.num_ready_groups)
    old = run.trainer.log_probs(batch.rank_batches)
    rank_batches = with_old_log_probs(batch.rank_batches, old)
    if config.algorithm.kl_coef > 0:  # KL to the frozen reference in the loss
        ref = run.trainer.log_probs(rank_batches, model="ref")
        rank_batches = [replace(b, ref_log_probs=r) for b, r in zip(rank_batches, ref, strict=True)]
    clock.lap("log_probs")
    metrics |= batch.metrics | mismatch(rank_batches)
    parts = minibatches(rank_batches, config.algorithm.num_minibatches)
    metrics |= run.trainer.train_steps(parts)  # the last minibatch's train metrics are kept
    clock.lap("train")
    if step % config.engine.sync_every == 0 or step == config.num_steps:
        metrics |= sync(run, version=step)
    clock.lap("sync")
    versions = [int(v) for s in batch.samples for v in s.weight_versions if v.isdigit()]
    metrics["rollout/weight_version_min"] = float(min(versions, default=-1))
    return metrics | clock.times()


def minibatches(rank_batches: list, num_minibatches: int) -> list[list]:
    """The step split into ``num_minibatches`` optimizer steps (PPO-style reuse of one
    rollout): each rank's sequences dealt round-robin, loss denominators per minibatch."""
    if num_minibatches == 1:
        return [rank_batches]
    parts = []
    for m in range(num_minibatches):
        picked = [b.select(range(m, b.num_seqs, num_minibatches)) for b in rank_batches]
        summed = [p.with_global_denominators() for p in picked]
        tokens = sum(p.global_num_tokens for p in summed)
        seqs = sum(p.global_num_seqs for p in summed)
        parts.append([replace(p, global_num_tokens=tokens, global_num_seqs=seqs) for p in picked])
    return [part for part in parts if any(p.num_seqs for p in part)]


def sync(run: Run, *, version: int) -> dict[str, float]:
    """Trainer weights into every engine; the engines then report ``version``."""
    sent = run.trainer.sync_weights(run.rollout.engine_urls, str(version), **run.sync_options)
    engine_versions = run.rollout.weight_versions()
    if any(v != str(version) for v in engine_versions):
        raise RuntimeError(f"weight sync to version {version} left engines at {engine_versions}")
    return {"sync/bytes": sent, "sync/weight_version": float(version)}


def mismatch(rank_batches) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's on the same weights."""
    diffs = [
        (b.old_log_probs - b.rollout_log_probs).abs()[b.loss_mask > 0]
        for b in rank_batches
        if b.rollout_log_probs is not None
    ]
    if not diffs:
        return {}
    diff = torch.cat(diffs)
    return {"mismatch/logprob_abs_diff_mean": float(diff.mean()),
            "mismatch/logprob_abs_diff_max": float(diff.max())}  # fmt: skip


def save(run: Run, step: int) -> None:
    root = checkpoints.checkpoint_dir(run.config)
    path = checkpoints.step_path(root, step)
    path.mkdir(parents=True, exist_ok=True)
    run.trainer.save(str(path / "trainer"))
    state = {"step": step, "weight_version": step, "data": run.source.state_dict()}
    checkpoints.write_state(path, state)
    checkpoints.prune(root, run.config.checkpoint.keep_last)


def resume(run: Run) -> int:
    """Load the newest complete checkpoint (if any); returns its step (0 when none)."""
    found = checkpoints.newest(checkpoints.checkpoint_dir(run.config))
    if found is None:
        print("rl-train: --resume found no complete checkpoint; starting at step 1", flush=True)
        return 0
    path, state = found
    run.trainer.load(str(path / "trainer"))
    run.source.load_state_dict(state["data"])
    sync(run, version=int(state["weight_version"]))
    dropped = truncate_metrics(run.config.logging.run_dir, int(state["step"]))
    print(f"rl-train: resumed from {path} (step {state['step']}; {dropped} later metrics "
          "records dropped)", flush=True)  # fmt: skip
    return int(state["step"])


class Clock:
    """Wall time of each part of a step: ``time/<part>`` and ``time/step``."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.parts: dict[str, float] = {}

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part], self.last = now - self.last, now

    def times(self) -> dict[str, float]:
        parts = {f"time/{name}": seconds for name, seconds in self.parts.items()}
        return parts | {"time/step": time.perf_counter() - self.start}


def _plot(run_dir: Path) -> None:
    from rl_launcher.plots import plot_run

    written = plot_run(run_dir)
    print(f"rl-train: {len(written)} charts in {run_dir / 'plots'}", flush=True)
