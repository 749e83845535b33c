"""The GRPO / PPO-style training loop; every step reads like the algorithm:

    rollout (engines)  ->  buffer (groups, filter, advantages, per-rank batches)
    ->  old log-probs (trainer)  ->  train step  ->  weight sync (engines at version = step)

``rollout.loop`` picks the feed of groups (:mod:`rl_launcher.loops.feeds`): synchronous,
one-step off-policy (the next rollout overlaps this step's training) or fully
asynchronous (continuous generation, bounded staleness). ``train(config)`` sets everything
up (model directory, data, Ray, training actor group, engines and router), optionally
resumes from the newest complete checkpoint, runs ``num_steps`` steps writing
``metrics.jsonl``, ``data_order.jsonl`` and a progress line per step, checkpoints every
``checkpoint.interval`` steps and at the end, and draws the charts.

Around the step: the run it drives (:mod:`rl_launcher.session`), its weight sync and
checkpoints (:mod:`.rl_state`), the metrics it adds about itself (:mod:`.step_metrics`)
and the plumbing it shares with SFT (:mod:`.step`).
"""

import contextlib
import sys
import time
from pathlib import Path

import torch

from rl_launcher.config.checks import check_loop
from rl_launcher.data.buffer import DataBuffer
from rl_launcher.infra import data_order, faults, resume_choice, stopping
from rl_launcher.infra.gc_pauses import GcPauses, freeze_startup, unfreeze
from rl_launcher.loops.extras import after_step, dump_step
from rl_launcher.loops.feeds import SyncFeed, make_feed
from rl_launcher.loops.rl_state import resume, save, sync
from rl_launcher.loops.step import Clock, draw_charts_meanwhile, finish_step, minibatches
from rl_launcher.loops.step_metrics import (
    empty_step,
    log_prob_gap,
    split_step,
    staleness,
    trained_tokens,
    turn_times,
    with_gap_seqs,
)
from rl_launcher.loops.train_phase import (
    dump_train_batches,
    refresh_reference,
    restore_reference,
    train_policy,
    with_old_policy,
)
from rl_launcher.roles.critic import make_buffer, train_critic
from rl_launcher.roles.evaluation import evaluate_at_start
from rl_launcher.roles.reference import with_reference
from rl_launcher.roles.rollout_workers import rows_buffer
from rl_launcher.roles.step_hooks import apply_step_hooks
from rl_launcher.roles.teacher import score_groups
from rl_launcher.session.run import Run
from rl_launcher.session.start import start_run

# The driver's own tensors are bookkeeping (token ids, masks, log-probs on the host). On a
# 32-core GPU host busy with engines and training processes, the train phase's driver work
# took ~0.3 s a step (10 ms on a 2-core CPU machine) with torch's default of one thread per
# core; a small pool avoids waking dozens of threads for ops on a few thousand numbers.
DRIVER_TORCH_THREADS = 2


def train(config) -> Path:
    """Run ``config`` to its last step; returns the run directory."""
    check_loop(config)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, DRIVER_TORCH_THREADS))
    try:
        return _train(config)
    finally:
        torch.set_num_threads(threads)


def _train(config) -> Path:
    chosen = resume_choice.chosen(config)  # before anything starts: a bad --resume fails fast
    started = time.perf_counter()
    with contextlib.closing(start_run(config)) as run:
        first = resume(run, chosen) + 1 if config.checkpoint.resume else 1
        restore_reference(run, chosen if config.checkpoint.resume else None)  # older checkpoints
        buffer = make_buffer(run)  # a GaeBuffer (critic values) for advantage_estimator=gae
        buffer = rows_buffer(run) or buffer  # rollout.data_plane=workers: samples by reference
        freeze_startup()  # full collections walk only what the steps leave
        pauses = GcPauses()
        run._cleanup += [pauses.close, unfreeze]
        feed = make_feed(run, last_step=config.num_steps)  # sync, one_step_async or async
        run._cleanup.append(feed.close)
        evaluate_at_start(run, first)  # eval.at_start: the starting weights, as step 0
        say_ready(config, first, time.perf_counter() - started)
        with stopping.stepping(run, save, first):  # SIGTERM / SIGINT: stop at a step boundary
            for step in range(first, config.num_steps + 1):
                metrics = run_step(run, buffer, step, feed)
                if step == first:
                    freeze_engine_gc(run)  # the engines are warm: their start-up objects stay
                metrics |= after_step(run, step)  # evaluation, counted reward errors
                metrics |= pauses.take()  # the driver's garbage-collection pauses
                finish_step(run, step, metrics, save)
        charts = draw_charts_meanwhile(Path(config.logging.run_dir))  # while the run closes
    charts.result()
    return Path(config.logging.run_dir)


def say_ready(config, first: int, seconds: float) -> None:
    """The last start-up line: the first step begins (its progress line comes when it ends)."""
    if config.logging.progress:
        print(
            f"rl-train: started in {seconds:.1f}s; step {first}/{config.num_steps} running",
            flush=True,
        )


def freeze_engine_gc(run) -> None:
    """``engine.freeze_gc``: every engine's processes move what they hold after the first
    step into Python's permanent generation, so their later full collections (pauses in
    the middle of a rollout) walk only what the steps leave."""
    if not run.config.engine.freeze_gc:
        return
    engines = run.rollout.engines
    for url, answer in zip(engines.urls, engines.freeze_gc(), strict=True):
        print(f"rl-train: engine {url}: {answer}", file=sys.stderr, flush=True)


def start_training_turn(run: Run) -> None:
    """Colocated turns (:mod:`rl_launcher.infra.colocation`): the engines release their
    memory and the trainer's onload starts before the driver builds the step's batches."""
    turns = run.trainer.turns
    if turns is not None:
        turns.preparing_training()


def run_step(run: Run, buffer: DataBuffer, step: int, feed=None) -> dict[str, float]:
    config, clock, feed = run.config, Clock(), feed or SyncFeed(run)
    with stopping.generating(step):  # a stop signal may abandon the step here (only)
        groups, metrics = feed.groups(step)
    groups, metrics = apply_step_hooks(run, step, groups, metrics)  # sample_filter, post_process
    buffer.add_groups(groups)  # whole: a forked agent episode gives its group more samples
    clock.lap("rollout")
    if score_groups(run, groups):  # distill.*: the teacher's log-prob of every response token
        clock.lap("teacher")
    data_order.append(config.logging.run_dir, step, groups)
    dump_step(run, step, groups)  # rollout.dump_dir
    run.rollout.consumed(groups)
    metrics[faults.BATCH_KEY] = float(sum(len(group) for group in groups))
    if buffer.num_ready_groups == 0:  # every group aborted or filtered: nothing to learn from
        return metrics | empty_step(groups, config) | buffer.take_counts() | clock.times()
    start_training_turn(run)  # colocated: the trainer's onload runs while the batch is built
    batch = buffer.pop_step(buffer.num_ready_groups)
    metrics[faults.TRAINED_KEY] = float(len(batch.samples))
    rank_batches = with_gap_seqs(batch, trainer_version=step - 1)  # data_plane=workers
    rank_batches = with_old_policy(run, rank_batches)  # recompute, rollout, train_step
    rank_batches = with_reference(run, buffer, batch, rank_batches)  # KL in loss and/or reward
    clock.lap("log_probs")
    metrics |= batch.metrics | staleness(batch, trainer_version=step - 1)
    if config.algorithm.old_log_probs == "recompute":  # else the train step measures the gap
        metrics |= log_prob_gap(rank_batches, batch, trainer_version=step - 1)
    dump_train_batches(run, step, rank_batches)  # logging.dump_train_batch
    parts = minibatches(rank_batches, config.algorithm.num_minibatches)
    metrics |= train_policy(run, step, parts)  # the last minibatch's train metrics are kept
    metrics |= train_critic(run, parts)  # PPO's critic, when there is one
    metrics |= refresh_reference(run, step)  # algorithm.ref_update_interval
    clock.lap("train")
    if step % config.engine.sync_every == 0 or step == config.num_steps:
        feed.before_sync()  # one-step async: the overlapping rollout ends; async: engines pause
        clock.lap("rollout_wait")
        metrics |= sync(run, version=step)
        feed.after_sync()
    clock.lap("sync")
    metrics |= turn_times(run)
    return metrics | split_step(clock.times(), metrics, trained_tokens(parts))
