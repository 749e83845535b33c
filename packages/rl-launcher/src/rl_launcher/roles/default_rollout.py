"""The built-in rollout, a rollout function like any ``rollout.rollout_function``:

    rollout:
      rollout_function: rl_launcher.roles.default_rollout:default_rollout   # = leaving it unset

It reads the run only through its :class:`~rl_launcher.roles.rollout_context.RolloutContext`
(engine client, prompts, sampling parameters, reward, config), and the manager runs it
through the same :func:`~rl_launcher.roles.rollout_context.run_rollout` as a custom one.
The asynchronous loop's producer calls :func:`generate_groups` chunk after chunk.
"""

import math

from rl_core.types import Sample
from rl_launcher.roles.rollout_context import RolloutContext


async def default_rollout(ctx: RolloutContext) -> list[list[Sample]]:
    """rl-sglang's default rollout of ``ctx.num_groups`` prompts, ``group_size`` scored
    samples each; with DAPO's refill (:func:`refills`) until that many pass the filter.
    Groups an engine error aborted are returned too (the buffer counts and drops them)."""
    if refills(ctx.config):
        return await refill_rollout(ctx)
    result = await generate_groups(ctx, ctx.num_groups)
    ctx.metrics.update(result.metrics)
    return result.groups + result.leftovers


async def refill_rollout(ctx: RolloutContext) -> list[list[Sample]]:
    """DAPO's refill (``rollout.over_sampling`` with ``algorithm.group_filter``): the last
    rollout's leftovers, then new prompts drawn one launch at a time, up to
    ceil(over_sampling x num_groups) groups in all, until ``num_groups`` pass the filter.
    Groups the filter drops are forgotten (as the buffer's are); groups still running are
    aborted and handed on in ``ctx.leftovers`` (their partial responses with
    ``rollout.partial_rollout``, else restarted): their prompts stay pending, so a
    checkpoint keeps them and ``--resume`` draws them first."""
    from rl_launcher.roles.async_rollout import failed, restart

    budget = math.ceil(ctx.config.rollout.over_sampling * ctx.num_groups)
    resume, ctx.leftovers = ctx.leftovers, []
    result = await generate_groups(ctx, max(0, budget - len(resume)), resume=resume, filtered=True)
    kept = [g for g in result.leftovers if not failed(g)]
    ctx.leftovers = kept if ctx.config.rollout.partial_rollout else list(map(restart, kept))
    ctx.metrics.update(result.metrics)
    ctx.metrics["rollout/groups_passed"] = float(len(result.groups))
    ctx.metrics["rollout/groups_aborted"] = float(len(kept))
    return result.groups + [g for g in result.leftovers if failed(g)]


async def generate_groups(ctx: RolloutContext, num_prompts: int, resume=(), filtered=False):
    """rl-sglang's default rollout (a RolloutResult) of ``resume`` (leftover groups) then
    ``num_prompts`` new prompts (exactly: none over-drawn, each drawn when its group
    launches), until ``ctx.num_groups`` groups are done (``filtered``: passed
    ``algorithm.group_filter``, the others dropped, the rest aborted) or nothing is left;
    groups are relabelled by draw number and sorted by it."""
    from rl_sglang.rollout.default import default_rollout as sglang_rollout

    result = await sglang_rollout(
        ctx.generate_context(),
        ctx.prompts(num_prompts),
        ctx.reward_fn,
        rollout_settings(ctx.config, ctx.num_groups, ctx.sampling_params, filtered=filtered),
        resume=resume,
        engines=ctx.engines if filtered else (),
    )
    for group in [*result.groups, *result.leftovers]:
        relabel(group)
    result.groups.sort(key=lambda group: group[0].group_index)
    return result


def rollout_settings(config, num_groups: int, sampling_params: dict, filtered: bool = False):
    """rl-sglang's RolloutConfig for ``num_groups`` groups (``filtered``: that pass
    ``algorithm.group_filter``). The run's reward applies ``rollout.reward_timeout_s`` and
    ``rollout.on_reward_error`` itself (:mod:`rl_launcher.roles.reward`: a failure it skips
    is a sample aborted and counted), so rl-sglang's guard has no time limit and raises what
    gets past it."""
    from rl_sglang.rollout.default import RolloutConfig

    rollout, algorithm = config.rollout, config.algorithm
    return RolloutConfig(
        num_groups=num_groups,
        n_samples_per_prompt=rollout.group_size,
        sampling_params=sampling_params,
        partial_rollout=True,
        max_concurrency=num_groups * rollout.group_size,
        generate_fn=None if rollout.function == "default" else rollout.function,
        group_requests=not unloads_sglang_adapters(config),
        reward_timeout_s=None,
        reward_on_error="raise",
        reward_key=algorithm.reward_key,
        group_filter=algorithm.group_filter if filtered else None,
    )


def unloads_sglang_adapters(config) -> bool:
    """SGLang engines that get LoRA adapters by name (``model.lora_sync: adapter``): each
    sync unloads an old adapter, and SGLang 0.5's ``/unload_lora_adapter`` never returns
    once parallel-sampling requests (``n`` > 1) used the adapter, wedging the scheduler
    (sgl-project/sglang#36894: its usage counter stays off zero). Such runs send one request
    per sample instead; the engine still batches them."""
    from rl_launcher.roles.lora import syncs_adapter

    return config.engine.kind == "sglang" and syncs_adapter(config)


def refills(config) -> bool:
    """The synchronous rollout refills filtered groups (DAPO): ``rollout.over_sampling`` > 1
    with ``algorithm.group_filter`` set (config/checks.py refuses the loops and sources
    where it cannot)."""
    return config.rollout.over_sampling > 1 and config.algorithm.group_filter != "keep_all"


def relabel(group: list[Sample]) -> None:
    """rl-sglang numbers groups from 0 in every rollout call; the launcher's groups are
    numbered by draw (unique across calls, so groups of several calls never mix)."""
    draw = group[0].metadata["draw"]
    for i, sample in enumerate(group):
        sample.group_index, sample.index = draw, draw * len(group) + i
