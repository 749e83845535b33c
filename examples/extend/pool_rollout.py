"""rollout.rollout_function: a whole step's rollout written by hand (docs/extending.md).

A fixed-size pool: ``POOL_SIZE`` groups generate at a time, a finished group makes room
for the next prompt, and once ``ctx.num_groups`` groups have finished the engines abort
the stragglers, whose prompts are dropped (over-provisioning against slow groups).
    uv run --package rl-launcher rl-train --config examples/extend/pool.yaml
"""

import asyncio

from rl_core.types import Sample, SampleStatus

POOL_SIZE = 4  # groups in flight at once
EXTRA_GROUPS = 2  # prompts drawn beyond ctx.num_groups, to make up for stragglers


async def pool_rollout(ctx) -> list[list[Sample]]:
    finished: list[list[Sample]] = []
    slots = asyncio.Semaphore(POOL_SIZE)

    async def one_group() -> list[Sample]:
        async with slots:
            if len(finished) >= ctx.num_groups:
                return []  # enough already: this prompt is never drawn
            group = ctx.new_group()
            group = list(await asyncio.gather(*(ctx.generate(s) for s in group)))
            await ctx.score(group)
            return group

    tasks = [asyncio.ensure_future(one_group()) for _ in range(ctx.num_groups + EXTRA_GROUPS)]
    for next_done in asyncio.as_completed(tasks):
        group = await next_done
        if group and all(s.status is not SampleStatus.ABORTED for s in group):
            finished.append(group)
        if len(finished) == ctx.num_groups:
            break
    await ctx.abort()  # the stragglers' requests come back aborted
    await asyncio.gather(*tasks, return_exceptions=True)
    return finished[: ctx.num_groups]
