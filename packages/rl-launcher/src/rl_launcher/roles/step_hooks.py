"""The user hooks between a step's rollout and its advantages (docs/extending.md):

    groups, metrics = feed.groups(step)
    groups, metrics = apply_step_hooks(run, step, groups, metrics)

``rollout.sample_filter`` (per sample: False leaves it out), then ``rollout.post_process``
(every group of the step, in place or returned anew), then
``logging.rollout_log_function`` (extra metrics from the groups that will train). A group
the hooks empty or drop is handed back to the rollout as consumed, so its prompt is not
drawn again after a resume.
"""

import math

from rl_core.types import Sample
from rl_launcher.config.extensions import load_hook


def apply_step_hooks(
    run, step: int, groups: list[list[Sample]], metrics: dict[str, float]
) -> tuple[list[list[Sample]], dict[str, float]]:
    config = run.config
    kept = filtered_samples(config, groups, metrics)
    post_process = load_hook(config, "rollout.post_process")
    if post_process is not None:
        returned = post_process(kept)
        kept = kept if returned is None else [list(group) for group in returned]
        kept = [group for group in kept if group]
    dropped = _dropped(groups, kept)
    if dropped:
        run.rollout.consumed(dropped)
    log_function = load_hook(config, "logging.rollout_log_function")
    if log_function is not None:
        metrics = metrics | logged_metrics(log_function(step, kept))
    return kept, metrics


def filtered_samples(config, groups, metrics) -> list[list[Sample]]:
    """``groups`` less the samples ``rollout.sample_filter`` refuses (empty groups gone);
    ``rollout/samples_filtered`` counts them."""
    keep = load_hook(config, "rollout.sample_filter")
    if keep is None:
        return groups
    kept = [[sample for sample in group if keep(sample)] for group in groups]
    metrics["rollout/samples_filtered"] = float(
        sum(len(g) for g in groups) - sum(len(g) for g in kept)
    )
    return [group for group in kept if group]


def _dropped(before: list[list[Sample]], after: list[list[Sample]]) -> list[list[Sample]]:
    remaining = {group[0].group_index for group in after}
    return [group for group in before if group and group[0].group_index not in remaining]


def logged_metrics(values) -> dict[str, float]:
    """A rollout log function's mapping as finite floats; anything else is refused."""
    if not isinstance(values, dict):
        raise ValueError(
            f"logging.rollout_log_function returned {type(values).__name__}; expected a "
            "mapping of metric names to numbers"
        )
    metrics = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"logging.rollout_log_function: metric {name!r} is {value!r:.80}")
        if not math.isfinite(value):
            raise ValueError(f"logging.rollout_log_function: metric {name!r} is {value}")
        metrics[str(name)] = float(value)
    return metrics
