"""Runs with one half of the loop: train-only replay and rollout-only.

- :func:`start_replay_run` (``rollout.replay_dir``): the training actor group and a
  :class:`~rl_launcher.run.dumps.ReplayRollout` in place of the engines and the prompt
  source; the usual loop then trains on the dumped rollouts.
- :func:`rollout_only` (``rollout.rollout_only``): engines, router, prompts and reward, no
  trainer and no Ray; each step generates and scores ``rollout.batch_size`` groups,
  writes their metrics (and dumps them with ``rollout.dump_dir``).
"""

import contextlib
import time
from pathlib import Path

from rl_core.metrics import summarize
from rl_core.types import SampleStatus
from rl_launcher.run_log import MetricsLog, format_progress


def _new_run(config, source_fn):
    """A Run with its model prepared and a metrics log; ``source_fn(tokenizer)`` gives the source."""
    from rl_launcher.run.model_setup import prepare_model
    from rl_launcher.run.setup import Run, check_fresh, sync_options

    run_dir = Path(config.logging.run_dir)
    check_fresh(config, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir, tokenizer = prepare_model(config.model, run_dir=run_dir, seed=config.seed)
    run = Run(config=config, source=source_fn(tokenizer),
              metrics_log=MetricsLog(run_dir, logging=config.logging),
              sync_options=sync_options(config, run_dir))  # fmt: skip
    run._cleanup.append(run.metrics_log.close)
    return run, model_dir, tokenizer


def start_replay_run(config):
    """A train-only run on the dumps of ``rollout.replay_dir`` (no engines start)."""
    from rl_launcher.run.critic import start_critic
    from rl_launcher.run.dumps import ReplayRollout
    from rl_launcher.run.setup import _start_trainer

    replay = ReplayRollout(config.rollout.replay_dir, group_size=config.rollout.group_size)
    run, model_dir, _ = _new_run(config, lambda tokenizer: replay)
    run.rollout = replay
    try:
        _start_trainer(run, model_dir)
        start_critic(run, model_dir)  # PPO with a critic (gae) only
    except BaseException:
        run.close()
        raise
    return run


def start_engines(config, *, model_dir, tokenizer, source, log_dir: Path, cleanup: list,
                  reward=None):  # fmt: skip
    """A rollout manager with its engines and router started, without Ray or a trainer
    (engines on the default devices); its stop is appended to ``cleanup``. ``reward``: a
    reward that exists already (see :class:`RolloutManager`)."""
    from rl_launcher.run.rollout_manager import RolloutManager

    manager = RolloutManager(config, model_dir=model_dir, tokenizer=tokenizer, source=source,
                             log_dir=log_dir, reward=reward)  # fmt: skip
    cleanup.append(manager.stop)
    return manager.start()


def start_rollout_only(config):
    from rl_launcher.data import build_prompt_source

    def source(tokenizer):
        return build_prompt_source(config.data, seed=config.seed, tokenizer=tokenizer)

    run, model_dir, tokenizer = _new_run(config, source)
    try:
        run.rollout = start_engines(config, model_dir=model_dir, tokenizer=tokenizer,
                                    source=run.source, log_dir=Path(config.logging.run_dir) / "logs",
                                    cleanup=run._cleanup)  # fmt: skip
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
    from rl_launcher.run.extras import after_step, dump_step

    with contextlib.closing(start_rollout_only(config)) as run:
        for step in range(1, config.num_steps + 1):
            start = time.perf_counter()
            groups, metrics = run.rollout.rollout(config.rollout.batch_size)
            dump_step(run, step, groups)
            metrics |= rollout_metrics(groups) | {"time/rollout": time.perf_counter() - start}
            metrics |= after_step(run, step)
            metrics["time/step"] = time.perf_counter() - start
            run.metrics_log.append(step, metrics)
            if config.logging.progress:
                print(format_progress(step, config.num_steps, metrics), flush=True)
    return Path(config.logging.run_dir)
