"""What the loops call around their steps for the optional features, one hook each:

- :func:`dump_step` (when a step has its groups): rollout dumps;
- :func:`after_step` (after a step's metrics, before they are written): counted reward
  failures (:func:`reward_counts`), each engine's node in the first record
  (:func:`engine_nodes`), evaluation every ``eval.interval`` steps;
- :func:`save_extras` / :func:`load_extras` (with each checkpoint): the critic, the
  Hugging Face export (``checkpoint.save_hf``), the dump numbering.

The critic itself joins through :mod:`rl_launcher.roles.critic` (``make_buffer``,
``train_critic``, ``start_critic``).
"""

from pathlib import Path


def dump_step(run, step: int, groups: list) -> None:
    """Step ``step``'s groups to ``rollout.dump_dir`` (``rollout_<step>.jsonl``), if set."""
    from rl_launcher.infra.dumps import dump_path, write_rollout

    if run.config.rollout.dump_dir:
        write_rollout(dump_path(run.config.rollout.dump_dir, step), groups)


def after_step(run, step: int) -> dict[str, float]:
    """Metrics the features add to step ``step``'s record."""
    from rl_launcher.roles.evaluation import maybe_evaluate

    metrics = data_stats(run) | engine_nodes(run) | reward_counts(run)
    if (monitor := run.extras.get("gpu_monitor")) is not None:
        metrics |= monitor.take()  # gpu/util/<i>, gpu/mem_gb/<i> over the step
    return metrics | maybe_evaluate(run, step)


def reward_counts(run) -> dict[str, float]:
    """``rollout/reward_errors`` and ``rollout/reward_timeouts`` since the last step: the
    failures the run's reward skipped plus those rl-sglang's rollout counted itself, which
    the rollout manager adds to the reward's counts (``take_rollout_counts``), so neither
    hides the other, in every loop."""
    if run.rollout.reward_fn is None:  # a replay scores nothing
        return {}
    counts = run.rollout.reward_fn.take_counts()
    return {f"rollout/{name}": float(count) for name, count in counts.items()}


def data_stats(run) -> dict[str, float]:
    """What loading the data kept and dropped, per dataset, in the first record of a run."""
    if run.extras.get("data_stats_logged"):
        return {}
    run.extras["data_stats_logged"] = True
    metrics = {}
    for name, stats in run.source.stats.items():
        metrics |= {f"data/{name}/{field}": float(n) for field, n in stats.counts().items()}
    return metrics


def engine_nodes(run) -> dict[str, str]:
    """Where each engine runs, in the first record of each rl-train process (a resumed run
    may be placed elsewhere): ``engine/<e>/node``, the Ray node id (as ``ray list nodes``
    and the start-up layout show it), ``engine/<e>/url`` and ``engine/<e>/weights_from``,
    the training rank that hands it the weights. Engines started without Ray (no node) add
    nothing."""
    if run.extras.get("engine_nodes_logged"):
        return {}
    run.extras["engine_nodes_logged"] = True
    metrics = {}
    engines = run.rollout.engines
    senders = run.sync_options.get("senders") or [0] * len(engines.urls)
    for index, (node, url) in enumerate(zip(engines.nodes(), engines.urls, strict=True)):
        if node is not None:
            metrics[f"engine/{index}/node"] = node
            metrics[f"engine/{index}/url"] = url
            metrics[f"engine/{index}/weights_from"] = float(senders[index])
    return metrics


def save_extras(run, path: Path) -> None:
    """The critic's state (``critic/``) and the HF export (``hf/``) beside the trainer's."""
    if run.critic is not None:
        run.critic.save(str(path / "critic"))
    if run.config.checkpoint.save_hf:
        run.trainer.export_hf(str(path / "hf"))


def load_extras(run, path: Path, state: dict) -> None:
    """Undo :func:`save_extras` on resume."""
    if run.critic is not None:
        if not (path / "critic").is_dir():
            raise ValueError(f"{path} has no critic/ state; it was saved by a run without a critic")
        run.critic.load(str(path / "critic"))
