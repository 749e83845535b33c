"""What the rollout of one step may use, as one object (:class:`RolloutContext`), and the
run of a rollout function against it (:func:`run_rollout`).

    async def my_rollout(ctx: RolloutContext) -> list[list[Sample]]:
        group = ctx.new_group()                                   # a prompt, group_size copies
        group = list(await asyncio.gather(*map(ctx.generate, group)))
        await ctx.score(group)
        return [group, ...]                                       # ctx.num_groups of them

The built-in rollout is a rollout function too
(:func:`rl_launcher.roles.default_rollout.default_rollout`), run by the same
:func:`run_rollout` as ``rollout.rollout_function``, so the two cannot drift. Prompts a
rollout draws and neither returns nor hands on (``ctx.leftovers``) are dropped (not drawn
again after a resume), like the groups a filter drops.
"""

import asyncio
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rl_core.types import Sample, SampleStatus


@dataclass(kw_only=True)
class RolloutContext:
    """One step's rollout: its size, the engines, the prompts, the sampling and the reward.

    ``client`` generates (the router, or the one engine); ``engines`` are each engine's own
    client (``abort`` and pauses go to every engine: the router does not forward them).

    ``step`` is the rl-train step the rollout was started for, the same after ``--resume``:
    in the synchronous loop the step that trains on it; in ``one_step_async`` the step too,
    though the rollout runs while the step before it trains; in the ``async`` loop (the
    built-in's chunks only) the first step that may take its groups (the engines' weight
    version + 1). ``rollout_id`` counts the rollouts this process started before this one.

    ``metrics`` are added to the step's record (the built-in puts rl-sglang's rollout
    metrics there). ``leftovers`` are the groups the last rollout handed on; a rollout sets
    it to the unfinished groups the next one should continue (their prompts stay pending,
    so a checkpoint keeps them): DAPO's refill does.
    """

    step: int
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
    config: Any  # the run's TrainConfig (read only)
    metrics: dict[str, float] = field(default_factory=dict)
    leftovers: list[list[Sample]] = field(default_factory=list)

    def generate_context(self):
        """rl-sglang's GenerateContext of this rollout (what generate functions receive)."""
        from rl_launcher.config.routing_checks import routed_experts_shape
        from rl_sglang.rollout.generate import GenerateContext

        shape = routed_experts_shape(self.config)  # None unless algorithm.routing_replay
        return GenerateContext(
            client=self.client, tokenizer=self.tokenizer, routed_experts_shape=shape
        )

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


async def run_rollout(function, ctx: RolloutContext, drawn: dict) -> list[list[Sample]]:
    """``function(ctx)``'s groups, checked and in draw order; the prompts it drew (``drawn``:
    the manager's pending prompts by draw number) and neither returned nor left in
    ``ctx.leftovers`` are forgotten, their count in ``ctx.metrics``."""
    before = set(drawn) - {group[0].group_index for group in ctx.leftovers}
    groups = checked_groups(await function(ctx), function)
    kept = {group[0].group_index for group in [*groups, *ctx.leftovers]}
    dropped = sorted(set(drawn) - before - kept)
    for draw in dropped:
        drawn.pop(draw, None)
    samples = [s for group in groups for s in group]
    ctx.metrics["rollout/prompts_dropped"] = float(len(dropped))
    ctx.metrics.setdefault(
        "rollout/response_length_mean",
        sum(s.response_length for s in samples) / max(len(samples), 1),
    )
    return sorted(groups, key=lambda group: group[0].group_index)


def checked_groups(groups, function) -> list[list[Sample]]:
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
        path = f"{function.__module__}:{function.__qualname__}"
        raise ValueError(
            f"rollout.rollout_function {path!r} {problem}; expected list[list[Sample]], one "
            "list per prompt drawn with ctx.new_group() / ctx.next_prompt()"
        )
    return groups


def context_of(manager, num_groups: int, step: int) -> RolloutContext:
    """The context of the manager's next rollout, for rl-train step ``step``."""
    client, engines = _engine_clients(manager)
    rollout_id = manager._rollouts_started
    manager._rollouts_started = rollout_id + 1
    return RolloutContext(
        step=step,
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
        config=manager.config,
    )


def _engine_clients(manager) -> tuple[Any, list]:
    """(the generating client, each engine's client) of the manager's engine pool."""
    pool = manager.engines
    return pool.client(pool.url), [pool.client(url) for url in pool.urls]
