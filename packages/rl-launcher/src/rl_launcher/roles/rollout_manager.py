"""The rollout manager: the run's engines (an :class:`~rl_launcher.roles.engine_pool.EnginePool`),
the prompt source and the reward.

    manager = RolloutManager(config, model_dir=..., tokenizer=tok, source=prompts).start()
    groups, metrics = manager.rollout(num_groups=8)   # lists of group_size scored Samples
    future = manager.submit(num_groups=8)               # the same, in the background
    manager.engines.weight_versions()                   # one per engine
    manager.stop()

Generation goes through the real sglang-router (or one engine directly when
``engine.use_router`` is false), on the pool's event loop; aborts, pauses and weight
updates go to every engine through the pool.
Every prompt drawn is remembered until the loop trains on it (or drops it), so a
checkpoint can store the prompts in flight and a resumed run draws them again first.
With embedded engines each prompt's requests are seeded from the run's seed and the
prompt's draw number (:func:`request_seed`), so the same seed, machine and config sample
the same responses whatever requests share a batch (SGLang servers are not asked: see
docs/config.md, ``seed``).
"""

import asyncio
import hashlib
import math
from concurrent.futures import Future
from pathlib import Path

from rl_core.types import Sample
from rl_launcher.roles.engine_pool import EnginePool
from rl_launcher.roles.reward import COUNTS, load_run_reward
from rl_launcher.roles.rollout_context import context_of, custom_rollout


class RolloutManager:
    def __init__(self, config, *, model_dir: Path, tokenizer, source, log_dir: Path, reward=None):
        """``reward``: the run's :class:`~rl_launcher.roles.reward.Reward` when one exists
        already (rl-eval's); :meth:`stop` closes it either way."""
        self.engines = EnginePool(config, model_dir=model_dir, log_dir=log_dir)
        self.config, self.model_dir, self.tokenizer = config, Path(model_dir), tokenizer
        self.source, self.log_dir = source, Path(log_dir)
        # with a time limit, reward processes start here
        self.reward_fn = reward or load_run_reward(config, tokenizer)
        self._drawn: dict[int, Sample] = {}  # draw number -> prompt not yet trained on
        self._requeued: list[Sample] = []  # drawn before a resume: handed out first
        self._leftovers: list[list[Sample]] = []  # refill: groups aborted, resumed next step
        self._rollouts_started = 0  # a RolloutContext's rollout_id

    def start(self) -> "RolloutManager":
        """Start the engines and the router (:meth:`EnginePool.start`)."""
        self.engines.start(max_batch_size=self._batch_limit())
        return self

    def _batch_limit(self) -> int:
        samples = self.config.rollout.batch_size * self.config.rollout.group_size
        return max(1, min(256, -(-samples // self.config.engine.num_engines)))

    def rollout(self, num_groups: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """``num_groups`` prompts, ``group_size`` scored samples each (one prompt drawn per
        group), in draw order."""
        return self.submit(num_groups).result()

    def submit(self, num_groups: int) -> Future:
        """:meth:`rollout` in the background; ``.result()`` waits for it."""
        if self.engines.turns is not None:  # colocated: the devices go to the engines first
            self.engines.turns.generating()
        return asyncio.run_coroutine_threadsafe(self._rollout(num_groups), self.engines.loop)

    async def _rollout(self, num_groups: int):
        if self.config.rollout.rollout_function is not None:  # replaces all of the below
            return await custom_rollout(self, context_of(self, num_groups))
        if refills(self.config):
            return await self._refill(num_groups)
        result = await self.generate(num_groups, num_groups)
        # exactly num_groups prompts: leftovers are only groups an engine error aborted,
        # which the buffer counts and drops
        groups = sorted(result.groups + result.leftovers, key=lambda g: g[0].group_index)
        return groups, result.metrics

    async def _refill(self, num_groups: int):
        """DAPO's refill (``rollout.over_sampling`` with ``algorithm.group_filter``): last
        step's leftovers, then new prompts drawn one launch at a time, up to
        ceil(over_sampling x num_groups) groups in all, until ``num_groups`` pass the
        filter. Groups the filter drops are forgotten (as the buffer's are); groups still
        running are aborted and kept for the next step (their partial responses with
        ``rollout.partial_rollout``, else restarted): their prompts stay pending, so a
        checkpoint keeps them and ``--resume`` draws them first."""
        from rl_launcher.roles.async_rollout import failed, restart

        budget = math.ceil(self.config.rollout.over_sampling * num_groups)
        resume, self._leftovers = self._leftovers, []
        before = set(self._drawn)
        result = await self.generate(
            num_groups, max(0, budget - len(resume)), resume=resume, filtered=True
        )
        kept = [g for g in result.leftovers if not failed(g)]
        self._leftovers = kept if self.config.rollout.partial_rollout else list(map(restart, kept))
        returned = {g[0].group_index for g in [*result.groups, *result.leftovers]}
        drawn = set(self._drawn) - before | {g[0].group_index for g in resume}
        self._forget(sorted(drawn - returned))  # dropped by the filter: never trained on
        groups = result.groups + [g for g in result.leftovers if failed(g)]
        metrics = result.metrics | {
            "rollout/groups_passed": float(len(result.groups)),
            "rollout/groups_aborted": float(len(kept)),
        }
        return sorted(groups, key=lambda g: g[0].group_index), metrics

    async def generate(self, num_groups: int, num_prompts: int, resume=(), filtered=False):
        """rl-sglang's default rollout of ``resume`` (leftover groups) then ``num_prompts``
        new prompts (exactly: none over-drawn, each drawn when its group launches), until
        ``num_groups`` groups are done (``filtered``: passed ``algorithm.group_filter``,
        the others dropped, the rest aborted) or nothing is left; groups are relabelled by
        draw number and sorted by it."""
        from rl_sglang.rollout.default import default_rollout

        settings = self.rollout_settings(num_groups, filtered=filtered)
        ctx = context_of(self, num_groups)  # what a rollout.rollout_function is given
        engines = ctx.engines if filtered else ()
        result = await default_rollout(
            ctx.generate_context(),
            ctx.prompts(num_prompts),
            ctx.reward_fn,
            settings,
            resume=resume,
            engines=engines,
        )
        take_rollout_counts(self.reward_fn, result.metrics)
        for group in [*result.groups, *result.leftovers]:
            relabel(group)
        result.groups.sort(key=lambda group: group[0].group_index)
        return result

    def rollout_settings(self, num_groups: int, filtered: bool = False):
        """rl-sglang's RolloutConfig for ``num_groups`` groups (``filtered``: that pass
        ``algorithm.group_filter``). The run's reward applies
        ``rollout.reward_timeout_s`` and ``rollout.on_reward_error`` itself
        (:mod:`rl_launcher.roles.reward`: a failure it skips is a sample aborted and counted),
        so rl-sglang's guard has no time limit and raises what gets past it."""
        from rl_sglang.rollout.default import RolloutConfig

        rollout, algorithm = self.config.rollout, self.config.algorithm
        return RolloutConfig(
            num_groups=num_groups,
            n_samples_per_prompt=rollout.group_size,
            sampling_params=self.sampling_params(),
            partial_rollout=True,
            max_concurrency=num_groups * rollout.group_size,
            generate_fn=None if rollout.function == "default" else rollout.function,
            reward_timeout_s=None,
            reward_on_error="raise",
            reward_key=algorithm.reward_key,
            group_filter=algorithm.group_filter if filtered else None,
        )

    def next_prompt(self) -> Sample:
        """The next prompt (requeued ones first), remembered until :meth:`consumed`."""
        template = self._requeued.pop(0) if self._requeued else self.source.next_prompt()
        template.metadata["draw"] = template.group_index  # the source numbers its draws
        if self.config.engine.kind == "embedded":  # sample i of the group: this + i
            template.metadata["sampling_seed"] = request_seed(
                self.config.seed, template.group_index
            )
        self._drawn[template.group_index] = template
        return template

    def consumed(self, groups: list[list[Sample]]) -> None:
        """The loop is done with these groups' prompts (trained on or dropped)."""
        self.engines.loop.call_soon_threadsafe(self._forget, [g[0].group_index for g in groups])

    def _forget(self, draws: list[int]) -> None:
        for draw in draws:
            self._drawn.pop(draw, None)

    def data_state(self) -> dict:
        """The prompt source's position and the prompts drawn but not yet trained on, in
        draw order (JSON); taken on the event loop, so no draw happens half-way."""

        async def snapshot():
            pending = [self._drawn[d].to_dict() for d in sorted(self._drawn)]
            return {"source": self.source.state_dict(), "pending": pending}

        return self.engines.call(snapshot())

    def load_data_state(self, state: dict) -> None:
        """Continue from :meth:`data_state`: its pending prompts are drawn again first."""
        self.source.load_state_dict(state["source"])
        self._requeued = [Sample.from_dict(d) for d in state.get("pending", [])]

    def sampling_params(self) -> dict:
        rollout = self.config.rollout
        params = {
            "max_new_tokens": rollout.max_response_tokens,
            "temperature": rollout.temperature,
            "top_p": rollout.top_p,
            "top_k": rollout.top_k,
        }
        return params | ({"stop": list(rollout.stop)} if rollout.stop else {})

    def stop(self) -> None:
        self.engines.stop()  # first: a rollout still running is cancelled
        self.reward_fn.close()  # its worker processes


def take_rollout_counts(reward, metrics: dict[str, float]) -> None:
    """Move the reward failures rl-sglang's rollout counted (``rollout/reward_errors``,
    ``rollout/reward_timeouts`` in ``metrics``) into the run's ``reward``, whose counts
    reach every step's record in every loop (:func:`rl_launcher.loops.extras.reward_counts`):
    one count per name, neither hiding the other."""
    for name in COUNTS:
        reward.count(name, int(metrics.pop(f"rollout/{name}", 0)))


def refills(config) -> bool:
    """The synchronous rollout refills filtered groups (DAPO): ``rollout.over_sampling`` > 1
    with ``algorithm.group_filter`` set (config/checks.py refuses the loops and sources
    where it cannot)."""
    return config.rollout.over_sampling > 1 and config.algorithm.group_filter != "keep_all"


def request_seed(seed: int, key: int | str) -> int:
    """The ``sampling_seed`` of one prompt's requests: 62 bits of a hash of the run's
    ``seed`` and the prompt's ``key`` (its draw number), so prompts' seeds (and the seed + i
    of their samples) never meet, and runs whose seeds differ by one share none."""
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


def relabel(group: list[Sample]) -> None:
    """rl-sglang numbers groups from 0 in every rollout call; the launcher's groups are
    numbered by draw (unique across calls, so groups of several calls never mix)."""
    draw = group[0].metadata["draw"]
    for i, sample in enumerate(group):
        sample.group_index, sample.index = draw, draw * len(group) + i
