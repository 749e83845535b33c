"""The GRPO / PPO-style training loop; every step reads like the algorithm:

    rollout (engines)  ->  buffer (groups, filter, advantages, per-rank batches)
    ->  old log-probs (trainer)  ->  train step  ->  weight sync (engines at version = step)

``rollout.loop`` picks the feed of groups (:mod:`rl_launcher.run.feeds`): synchronous,
one-step off-policy (the next rollout overlaps this step's training) or fully
asynchronous (continuous generation, bounded staleness). ``train(config)`` sets everything
up (model directory, data, Ray, training actor group, engines and router), optionally
resumes from the newest complete checkpoint, runs ``num_steps`` steps writing
``metrics.jsonl``, ``data_order.jsonl`` and a progress line per step, checkpoints every
``checkpoint.interval`` steps and at the end, and draws the charts.
"""

import contextlib
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from rl_core.types import SampleStatus
from rl_launcher.buffer import DataBuffer
from rl_launcher.run import checkpoints, data_order, faults, resume_choice, stopping
from rl_launcher.run.critic import make_buffer, train_critic
from rl_launcher.run.engine_health import wait_for_restarts
from rl_launcher.run.evaluation import evaluate_at_start
from rl_launcher.run.extras import after_step, dump_step, load_extras, save_extras
from rl_launcher.run.feeds import SyncFeed, make_feed
from rl_launcher.run.gc_pauses import GcPauses, freeze_startup, unfreeze
from rl_launcher.run.reference import with_reference
from rl_launcher.run.setup import Run, start_run
from rl_launcher.run.train_group import with_old_log_probs
from rl_launcher.run_log import format_progress, truncate_metrics

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
        buffer = make_buffer(run)  # a GaeBuffer (critic values) for advantage_estimator=gae
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
    _plot(Path(config.logging.run_dir))
    return Path(config.logging.run_dir)


def say_ready(config, first: int, seconds: float) -> None:
    """The last start-up line: the first step begins (its progress line comes when it ends)."""
    if config.logging.progress:
        print(f"rl-train: started in {seconds:.1f}s; step {first}/{config.num_steps} running",
              flush=True)  # fmt: skip


def freeze_engine_gc(run) -> None:
    """``engine.freeze_gc``: every engine's processes move what they hold after the first
    step into Python's permanent generation, so their later full collections (pauses in
    the middle of a rollout) walk only what the steps leave."""
    if not run.config.engine.freeze_gc or not hasattr(run.rollout, "freeze_gc"):
        return
    for url, answer in zip(run.rollout.engine_urls, run.rollout.freeze_gc(), strict=True):
        print(f"rl-train: engine {url}: {answer}", file=sys.stderr, flush=True)


def check_loop(config) -> None:
    """Loop settings that only make sense together (ValueError with the fix)."""
    rollout, algorithm = config.rollout, config.algorithm
    importance = rollout.loop != "sync" and rollout.stale_policy == "importance"
    if algorithm.old_log_probs == "train_step" and (
        algorithm.num_minibatches > 1 or algorithm.reward_kl_coef > 0
    ):
        raise ValueError(
            "algorithm.old_log_probs=train_step takes the old log-probs from the one update's "
            "own forward: it needs algorithm.num_minibatches=1 and reward_kl_coef=0 (several "
            "updates, or a KL-shaped reward, need them before training: use recompute)"
        )  # fmt: skip
    if importance and not algorithm.rollout_is_level:
        raise ValueError(
            "rollout.stale_policy=importance corrects stale samples with rollout importance "
            "weights: set algorithm.rollout_is_level=token (or sequence)"
        )  # fmt: skip


def run_step(run: Run, buffer: DataBuffer, step: int, feed=None) -> dict[str, float]:
    config, clock, feed = run.config, Clock(), feed or SyncFeed(run)
    with stopping.generating(step):  # a stop signal may abandon the step here (only)
        groups, metrics = feed.groups(step)
    buffer.add(s for group in groups for s in group)
    clock.lap("rollout")
    data_order.append(config.logging.run_dir, step, groups)
    dump_step(run, step, groups)  # rollout.dump_dir
    if hasattr(run.rollout, "consumed"):  # stand-ins (replay) draw no prompts
        run.rollout.consumed(groups)
    metrics[faults.BATCH_KEY] = float(sum(len(group) for group in groups))
    if buffer.num_ready_groups == 0:  # every group aborted or filtered: nothing to learn from
        cause = faults.empty_cause(groups, config)  # said in the progress line, counted
        failed = sum(s.status is SampleStatus.ABORTED for group in groups for s in group)
        empty = {"buffer/empty_step": 1.0, faults.TRAINED_KEY: 0.0, faults.EMPTY_CAUSE_KEY: cause,
                 faults.EMPTY_FAILED_KEY: float(failed)}  # fmt: skip
        return metrics | empty | buffer.take_counts() | clock.times()
    batch = buffer.pop_step(buffer.num_ready_groups)
    metrics[faults.TRAINED_KEY] = float(len(batch.samples))
    rank_batches = batch.rank_batches
    if config.algorithm.old_log_probs == "recompute":  # else the train step's forward gives them
        rank_batches = with_old_log_probs(rank_batches, run.trainer.log_probs(rank_batches))
    rank_batches = with_reference(run, buffer, batch, rank_batches)  # KL in loss and/or reward
    clock.lap("log_probs")
    metrics |= batch.metrics | staleness(batch, trainer_version=step - 1)
    metrics |= mismatch(fresh_only(rank_batches, batch, trainer_version=step - 1))
    parts = minibatches(rank_batches, config.algorithm.num_minibatches)
    metrics |= run.trainer.train_steps(parts)  # the last minibatch's train metrics are kept
    metrics |= train_critic(run, parts)  # PPO's critic, when there is one
    clock.lap("train")
    if step % config.engine.sync_every == 0 or step == config.num_steps:
        feed.before_sync()  # one-step async: the overlapping rollout ends; async: engines pause
        clock.lap("rollout_wait")
        metrics |= sync(run, version=step)
        feed.after_sync()
    clock.lap("sync")
    metrics |= turn_times(run)
    return metrics | split_step(clock.times(), metrics, trained_tokens(parts))


def turn_times(run: Run) -> dict[str, float]:
    """Colocated GPUs: the step's engine release/resume and trainer offload/onload times
    (:meth:`rl_launcher.run.colocation.Turns.take_times`); nothing otherwise."""
    turns = getattr(run.trainer, "turns", None)
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
    wait_for_restarts(run)
    synced = run.trainer.sync_weights(run.rollout.engine_urls, str(version), **run.sync_options)
    engine_versions = run.rollout.weight_versions()
    if any(v != str(version) for v in engine_versions):
        raise RuntimeError(f"weight sync to version {version} left engines at {engine_versions}")
    run.weight_version = version  # what a restarted engine is given (run.engine_health)
    return synced | {"sync/weight_version": float(version)}


def sample_version(sample, default: int) -> int:
    """The oldest weight version that produced a token of ``sample``."""
    versions = [int(v) for v in set(sample.weight_versions) if v.lstrip("-").isdigit()]
    return min(versions, default=default)


def staleness(batch, *, trainer_version: int) -> dict[str, float]:
    """How many weight versions the step's samples lag the trainer's weights."""
    lags = [trainer_version - sample_version(s, trainer_version) for s in batch.samples]
    versions = [sample_version(s, -1) for s in batch.samples]
    resumed = sum(1 for s in batch.samples if s.metadata.get("resumed"))
    return {"rollout/weight_version_min": float(min(versions, default=-1)),
            "rollout/staleness_max": float(max(lags, default=0)),
            "rollout/staleness_mean": sum(lags) / max(len(lags), 1),
            "rollout/resumed_samples": float(resumed)}  # fmt: skip


def fresh_only(rank_batches, batch, *, trainer_version: int) -> list:
    """Each rank's sequences generated entirely with the trainer's current weights: only
    there do engine and trainer log-probs measure the same policy."""
    current = {str(trainer_version)}
    fresh = [
        [j for j, i in enumerate(part) if set(batch.samples[i].weight_versions) <= current]
        for part in batch.partitions
    ]
    return [b.select(keep) for b, keep in zip(rank_batches, fresh, strict=True) if keep]


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
    return {"mismatch/logprob_abs_diff_mean": float(diff.mean()),
            "mismatch/logprob_abs_diff_max": float(diff.max())}  # fmt: skip


def save(run: Run, step: int) -> None:
    root = checkpoints.checkpoint_dir(run.config)
    path = checkpoints.step_path(root, step)
    path.mkdir(parents=True, exist_ok=True)
    run.trainer.save(str(path / "trainer"))
    save_extras(run, path)  # critic, HF export
    data = data_state(run)  # prompts in flight (async loops) are drawn again on resume
    state = {"step": step, "weight_version": step, "data": data["source"],
             "pending_prompts": data["pending"]}  # fmt: skip
    checkpoints.write_state(path, state)
    checkpoints.prune(root, run.config.checkpoint.keep_last)


def data_state(run: Run) -> dict:
    """The data position to checkpoint: the source's and the prompts drawn, not trained."""
    if hasattr(run.rollout, "data_state"):
        return run.rollout.data_state()
    return {"source": run.source.state_dict(), "pending": []}  # a stand-in (replay)


def resume(run: Run, found: tuple[Path, dict] | None) -> int:
    """Load ``found``, the checkpoint ``checkpoint.resume`` named and its state
    (:func:`resume_choice.chosen`); returns its step (0 when there is none)."""
    if found is None:
        print("rl-train: --resume found no complete checkpoint; starting at step 1", flush=True)
        return 0
    path, state = found
    with resume_choice.loading(path):  # every error names the checkpoint
        run.trainer.load(str(path / "trainer"))
        load_extras(run, path, state)  # critic
        if hasattr(run.rollout, "load_data_state"):
            run.rollout.load_data_state({"source": state["data"],
                                         "pending": state.get("pending_prompts", [])})  # fmt: skip
        else:  # a stand-in rollout (replay) is its own source
            run.source.load_state_dict(state["data"])
        version = int(state["weight_version"])
    root = checkpoints.checkpoint_dir(run.config)
    resume_choice.set_aside_after(root, int(state["step"]))  # the steps after it are redone
    sync(run, version=version)
    dropped = truncate_metrics(run.config.logging.run_dir, int(state["step"]))
    data_order.truncate(run.config.logging.run_dir, int(state["step"]))
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


def finish_step(run, step: int, metrics: dict[str, float], save_fn) -> None:
    """Record a finished step (RL or SFT): metrics.jsonl, the progress line, the
    non-finite-step and empty-step rules, ``save_fn(run, step)`` every
    ``checkpoint.interval`` steps and at the last one, and a stop signal's step boundary."""
    config = run.config
    run.metrics_log.append(step, metrics)
    if config.logging.progress:
        print(format_progress(step, config.num_steps, metrics), flush=True)
    faults.check_step(run, step, metrics)  # too many non-finite steps stop the run
    faults.check_trained(run, step, metrics)  # so do steps that train nothing
    interval = config.checkpoint.interval
    saved = bool(interval and step % interval == 0) or step == config.num_steps
    if saved:
        save_fn(run, step)
    stopping.at_boundary(run, step, save_fn, saved=saved)  # after SIGTERM / SIGINT: stop here


def _plot(run_dir: Path) -> None:
    from rl_launcher.plots import plot_run

    written = plot_run(run_dir)
    print(f"rl-train: {len(written)} charts in {run_dir / 'plots'}", flush=True)
