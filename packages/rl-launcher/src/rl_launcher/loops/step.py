"""What every training loop (RL and SFT) does around its steps: time the parts of a step
(:class:`Clock`), split a step into optimizer steps (:func:`minibatches`), record a
finished step and checkpoint it (:func:`finish_step`), draw the charts at the end."""

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from rl_launcher.infra import faults, stopping
from rl_launcher.infra.run_log import format_progress


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
    faults.check_logprob_gap(config, step, metrics)  # algorithm.max_logprob_gap
    interval = config.checkpoint.interval
    saved = bool(interval and step % interval == 0) or step == config.num_steps
    if saved:
        save_fn(run, step)
    stopping.at_boundary(run, step, save_fn, saved=saved)  # after SIGTERM / SIGINT: stop here


def draw_charts(run_dir: Path) -> None:
    from rl_launcher.plots import plot_run

    written = plot_run(run_dir)
    print(f"rl-train: {len(written)} charts in {run_dir / 'plots'}", flush=True)


def draw_charts_meanwhile(run_dir: Path) -> Future:
    """:func:`draw_charts` on a worker thread, started once the last step is recorded, so
    that it overlaps the run's close (engines, router and Ray stopping: about 1.5 s on a
    2-core CPU). Safe on a thread: the charts use matplotlib's Agg canvas, no pyplot state.
    ``.result()`` waits for them and raises what drawing raised."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="charts")
    try:
        return pool.submit(draw_charts, run_dir)
    finally:
        pool.shutdown(wait=False)
