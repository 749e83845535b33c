"""``rollout.rollout_only``: the loop's first half alone. Engines, router, prompts and
reward, no trainer and no Ray; each step generates and scores ``rollout.batch_size``
groups, writes their metrics (and dumps them with ``rollout.dump_dir``).

(The other half, training alone on dumped rollouts with ``rollout.replay_dir``, is the RL
loop of :mod:`rl_launcher.loops.rl` on a run from
:func:`rl_launcher.session.start.start_replay_run`.)
"""

import contextlib
import time
from pathlib import Path

from rl_core.metrics import summarize
from rl_core.types import SampleStatus
from rl_launcher.infra.run_log import format_progress
from rl_launcher.loops.extras import after_step, dump_step
from rl_launcher.session.run import new_run
from rl_launcher.session.start import start_engines


def start_rollout_only(config):
    from rl_launcher.data import build_prompt_source

    def source(tokenizer):
        return build_prompt_source(config.data, seed=config.seed, tokenizer=tokenizer)

    run, model_dir, tokenizer = new_run(config, source)
    try:
        run.rollout = start_engines(
            config,
            model_dir=model_dir,
            tokenizer=tokenizer,
            source=run.source,
            log_dir=Path(config.logging.run_dir) / "logs",
            cleanup=run._cleanup,
        )
    except BaseException:
        run.close()
        raise
    return run


def rollout_metrics(groups) -> dict[str, float]:
    """Reward and length statistics of scored groups (what the buffer would report)."""
    samples = [s for group in groups for s in group]
    scored = [s for s in samples if s.status is not SampleStatus.ABORTED]
    rewards = [float(s.reward) for s in scored if isinstance(s.reward, int | float)]
    metrics = summarize(rewards, "rollout/reward")
    metrics |= summarize([s.response_length for s in scored], "rollout/response_length")
    metrics["rollout/num_samples"] = float(len(samples))
    metrics["rollout/aborted_samples"] = float(len(samples) - len(scored))
    return metrics


def rollout_only(config) -> Path:
    """Generate and score ``num_steps`` batches; returns the run directory."""
    with contextlib.closing(start_rollout_only(config)) as run:
        for step in range(1, config.num_steps + 1):
            start = time.perf_counter()
            groups, metrics = run.rollout.rollout(config.rollout.batch_size, step=step)
            dump_step(run, step, groups)
            metrics |= rollout_metrics(groups) | {"time/rollout": time.perf_counter() - start}
            metrics |= after_step(run, step)
            metrics["time/step"] = time.perf_counter() - start
            run.metrics_log.append(step, metrics)
            if config.logging.progress:
                print(format_progress(step, config.num_steps, metrics), flush=True)
    return Path(config.logging.run_dir)
