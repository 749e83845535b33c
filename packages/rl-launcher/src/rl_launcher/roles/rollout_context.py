"""What the rollout of one step may use, as one object (:class:`RolloutContext`), and the
run of ``rollout.rollout_function`` against it (:func:`custom_rollout`).

    async def my_rollout(ctx: RolloutContext) -> list[list[Sample]]:
        group = ctx.new_group()                                   # a prompt, group_size copies
        group = list(await asyncio.gather(*map(ctx.generate, group)))
        await ctx.score(group)
        return [group, ...]                                       # ctx.num_groups of them

The built-in rollout (:meth:`RolloutManager.generate`) takes its engine client, prompts,
tokenizer, sampling parameters and reward from the same context
(:meth:`RolloutContext.generate_context`, :meth:`RolloutContext.prompts`,
:attr:`RolloutContext.reward_fn`), so the two read the run the same way. Prompts a custom
rollout draws but does not return are dropped (not drawn again after a resume), like the
groups a filter drops.
"""

import asyncio
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rl_core.types import Sample, SampleStatus
from rl_launcher.config.extensions import load_hook


@dataclass(kw_only=True)
class RolloutContext:
    """One step's rollout: its size, the engines, the prompts, the sampling and the reward.

    ``client`` generates (the router, or the one engine); ``engines`` are each engine's own
    client (``abort`` and pauses go to every engine: the router does not forward them).
    ``rollout_id`` counts the rollouts this run started before this one (from 0, or from the
    resumed step's count), the step being ``rollout_id + 1`` in the synchronous loop.
    """

    rollout_id: int
    num_groups: int
    group_size: int
    sampling_params: dict
    tokenizer: Any
    client: Any  # rl_sglang.client.EngineClient
    engines: list
    source: Any  # the prompt source; draw through next_prompt, which remembers the draws
    draw: Callable[[], Sample]
    reward_fn: Callable  # the run's reward as the rollout calls it (rl_launcher.roles.reward)

    def generate_context(self):
        """rl-sglang's GenerateContext of this rollout (what generate functions receive)."""
        from rl_sglang.rollout.generate import GenerateContext

        return GenerateContext(client=self.client, tokenizer=self.tokenizer)

    def next_prompt(self) -> Sample:
        """The next prompt (numbered by draw, remembered for checkpoints until trained on)."""
        return self.draw()

    def prompts(self, num_prompts: int) -> Iterator[Sample]:
        """``num_prompts`` prompts, each drawn when it is asked for."""
        return (self.draw() for _ in range(num_prompts))

    def new_group(self) -> list[Sample]:
        """``group_size`` fresh copies of the next prompt, numbered as the built-in's are."""
        from rl_sglang.rollout.default import make_groups

        template = self.draw()
        return next(make_groups(iter([template]), self.group_size, template.group_index))

    async def generate(self, sample: Sample, sampling_params: dict | None = None) -> Sample:
        """``sample``'s response from the engines (rl-sglang's default generate function)."""
        from rl_sglang.rollout.generate import generate_sample

        sample.metadata["rid"] = uuid.uuid4().hex  # abort() reaches it; unique per request
        params = self.sampling_params if sampling_params is None else sampling_params
        return await generate_sample(self.generate_context(), sample, params)

    async def score(self, samples: list[Sample]) -> None:
        """Set the reward of every sample not aborted, as the built-in rollout does (the
        run's reward_timeout_s and on_reward_error apply)."""
        from rl_sglang.rollout.rewards import GroupScore, RewardGuard

        live = [s for s in samples if s.status is not SampleStatus.ABORTED]
        if isinstance(self.reward_fn, GroupScore):
            await self.reward_fn.score(live)
            return
        guard = RewardGuard(self.reward_fn, None, "raise")
        await asyncio.gather(*(guard.score(s) for s in live))

    async def abort(self) -> None:
        """Every engine aborts what it is generating; those requests return ``aborted``."""
        await asyncio.gather(*(engine.abort() for engine in self.engines))


async def custom_rollout(manager, ctx: RolloutContext) -> tuple[list[list[Sample]], dict]:
    """``rollout.rollout_function`` on ``ctx``: its groups (checked, by draw number) and the
    step's rollout metrics; prompts it drew and did not return are forgotten."""
    function = load_hook(manager.config, "rollout.rollout_function")
    before = set(manager._drawn)
    groups = checked_groups(await function(ctx), manager.config.rollout.rollout_function)
    returned = {group[0].group_index for group in groups}
    dropped = sorted(set(manager._drawn) - before - returned)
    manager._forget(dropped)
    samples = [s for group in groups for s in group]
    metrics = {
        "rollout/prompts_dropped": float(len(dropped)),
        "rollout/response_length_mean": sum(s.response_length for s in samples)
        / max(len(samples), 1),
    }
    return sorted(groups, key=lambda group: group[0].group_index), metrics


def checked_groups(groups, path: str) -> list[list[Sample]]:
    """``groups`` when they are lists of Samples, each of one drawn prompt."""
    problem = None
    if not isinstance(groups, list):
        problem = f"returned {type(groups).__name__}"
    elif not all(
        isinstance(g, list) and g and all(isinstance(s, Sample) for s in g) for g in groups
    ):
        problem = "returned something other than non-empty lists of Samples"
    elif any(len({s.group_index for s in g}) != 1 for g in groups):
        problem = "returned a group whose samples come from several prompts"
    if problem:
        raise ValueError(
            f"rollout.rollout_function {path!r} {problem}; expected list[list[Sample]], one "
            "list per prompt drawn with ctx.new_group() / ctx.next_prompt()"
        )
    return groups


def context_of(manager, num_groups: int) -> RolloutContext:
    """The context of the manager's next rollout (the built-in's or a custom one's)."""
    client, engines = _engine_clients(manager)
    rollout_id = manager._rollouts_started
    manager._rollouts_started = rollout_id + 1
    return RolloutContext(
        rollout_id=rollout_id,
        num_groups=num_groups,
        group_size=manager.config.rollout.group_size,
        sampling_params=manager.sampling_params(),
        tokenizer=manager.tokenizer,
        client=client,
        engines=engines,
        source=manager.source,
        draw=manager.next_prompt,
        reward_fn=manager.reward_fn.rollout_fn,
    )


def _engine_clients(manager) -> tuple[Any, list]:
    """(the generating client, each engine's client) of the manager's engine pool."""
    pool = manager.engines
    return pool.client(pool.url), [pool.client(url) for url in pool.urls]
