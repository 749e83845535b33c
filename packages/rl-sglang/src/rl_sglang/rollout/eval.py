"""Evaluation rollout: n samples per prompt for several datasets, pass@k and reward stats."""

import asyncio
from collections.abc import Mapping, Sequence

from rl_core.metrics import pass_at_k_groups, summarize
from rl_core.types import Sample, SampleStatus, scalar_reward
from rl_sglang.rollout.default import (
    RewardFn,
    RolloutConfig,
    _GroupRunner,
    make_groups,
)
from rl_sglang.rollout.generate import GenerateContext


async def eval_rollout(
    ctx: GenerateContext,
    datasets: Mapping[str, Sequence[Sample]],
    reward_fn: RewardFn,
    *,
    n_samples_per_prompt: int = 4,
    ks: Sequence[int] = (1,),
    sampling_params: dict | None = None,
    correct_threshold: float = 1.0,
    max_concurrency: int = 64,
    reward_key: str | None = None,
) -> tuple[dict[str, float], dict[str, list[list[Sample]]]]:
    """``(metrics, groups per dataset)``. Metrics per dataset ``eval/{name}/pass@{k}``,
    ``eval/{name}/reward/{mean,std,...}``, ``eval/{name}/truncated_frac``; a sample is
    correct when its reward is at least ``correct_threshold``."""
    config = RolloutConfig(
        num_groups=1,
        n_samples_per_prompt=n_samples_per_prompt,
        sampling_params=sampling_params or {"max_new_tokens": 64},
        max_concurrency=max_concurrency,
    )
    runner = _GroupRunner(ctx, reward_fn, config)
    metrics, all_groups = {}, {}
    for name, prompts in datasets.items():
        groups = list(make_groups(iter(prompts), n_samples_per_prompt, 0))
        groups = await asyncio.gather(*(runner.run(g) for g in groups))
        rewards = [[scalar_reward(s, reward_key, unscored=0.0) for s in g] for g in groups]
        correct = [[r >= correct_threshold for r in g] for g in rewards]
        for key, value in pass_at_k_groups(correct, ks).items():
            metrics[f"eval/{name}/{key}"] = value
        metrics.update(summarize([r for g in rewards for r in g], f"eval/{name}/reward"))
        samples = [s for g in groups for s in g]
        metrics[f"eval/{name}/truncated_frac"] = sum(
            s.status is SampleStatus.TRUNCATED for s in samples
        ) / len(samples)
        all_groups[name] = groups
    return metrics, all_groups
