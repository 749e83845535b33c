"""The default rollout: n samples per prompt, scored, filtered, over-sampled until the batch
is full, leftovers aborted (and kept for the next rollout when partial rollout is on).

    result = await default_rollout(ctx, prompts, reward_fn, config, engines=engine_clients)
    result.groups  # num_groups lists of n Samples
"""

import asyncio
import copy
import dataclasses
import itertools
import pickle
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp

from rl_core.filters import GROUP_FILTERS
from rl_core.types import Sample, SampleStatus, scalar_reward
from rl_sglang.client import EngineClient, EngineError
from rl_sglang.rollout.generate import (
    OFFPOLICY_MODES,
    GenerateContext,
    fresh_group,
    generate_group,
    generate_sample,
    load_function,
)
from rl_sglang.rollout.rewards import REWARD_ON_ERROR, GroupScore, RewardGuard

RewardFn = Callable[[Sample], "float | dict | asyncio.Future"]


@dataclass(kw_only=True)
class RolloutConfig:
    """``num_groups`` prompts' worth of ``n_samples_per_prompt`` samples per rollout.

    ``group_filter`` names an rl_core dynamic-sampling filter (None keeps every group);
    ``max_concurrency`` bounds samples in flight; ``partial_rollout`` keeps aborted
    leftovers (their tokens, log-probs and weight versions) for the next rollout;
    ``generate_fn`` is a dotted path to a custom generate function.

    Faults: a request that fails with a connection error or a 5xx (an engine killed
    mid-request) is sent again, from the sample's state before it, up to ``max_retries``
    times (backoff ``retry_backoff_s`` doubling); after that the group is kept as an
    aborted leftover with the error. A reward that raises, returns NaN/inf or (with
    ``reward_timeout_s``) takes longer is handled per ``reward_on_error``: "raise" stops
    the rollout with the error, "zero" scores 0.0, "drop" drops the sample's group
    (over-sampling replaces it); the last two are counted (rl_sglang.rollout.rewards).
    """

    num_groups: int
    n_samples_per_prompt: int = 4
    sampling_params: dict = field(default_factory=lambda: {"max_new_tokens": 64})
    max_concurrency: int = 64
    group_filter: str | None = None
    reward_key: str | None = None  # which entry of a dict reward the filter reads
    partial_rollout: bool = False
    offpolicy_tokens: str = "keep"
    generate_fn: str | None = None
    group_requests: bool = True  # a fresh group as one request with n samples (else n requests)
    max_retries: int = 3
    retry_backoff_s: float = 0.5
    reward_timeout_s: float | None = None  # set: sync rewards run in a thread, timed out
    # (that thread cannot be stopped: see rl_sglang.rollout.rewards for rewards that may hang)
    reward_on_error: str = "raise"

    def __post_init__(self):
        if self.num_groups < 1 or self.n_samples_per_prompt < 1 or self.max_concurrency < 1:
            raise ValueError("num_groups, n_samples_per_prompt and max_concurrency must be >= 1")
        if self.group_filter is not None:
            GROUP_FILTERS.get(self.group_filter)  # unknown names fail here, listing known ones
        if self.offpolicy_tokens not in OFFPOLICY_MODES:
            raise ValueError(f"offpolicy_tokens must be one of {OFFPOLICY_MODES}")
        if self.reward_on_error not in REWARD_ON_ERROR:
            raise ValueError(f"reward_on_error must be one of {REWARD_ON_ERROR}")
        if self.max_retries < 0 or (
            self.reward_timeout_s is not None and self.reward_timeout_s <= 0
        ):
            raise ValueError("need max_retries >= 0 and reward_timeout_s > 0 (or None)")


@dataclass
class RolloutResult:
    groups: list[list[Sample]]
    leftovers: list[list[Sample]]  # aborted groups, to resume when partial rollout is on
    metrics: dict[str, float]


class _GroupRunner:
    """Generates and scores one group under the shared semaphore."""

    def __init__(self, ctx, reward_fn, config: RolloutConfig):
        self.ctx = dataclasses.replace(ctx, offpolicy_tokens=config.offpolicy_tokens)
        self.reward_fn, self.config = reward_fn, config
        self.generate = load_function(config.generate_fn) if config.generate_fn else generate_sample
        self.semaphore = asyncio.Semaphore(config.max_concurrency)
        self.counts = {"generate_retries": 0}
        self.group_score = reward_fn if isinstance(reward_fn, GroupScore) else None
        per_sample = None if self.group_score else reward_fn
        self.guard = RewardGuard(per_sample, config.reward_timeout_s, config.reward_on_error)
        self._acquiring = asyncio.Lock()  # one group takes its n semaphore slots at a time

    async def run(self, group: list[Sample]) -> list[Sample]:
        """The group generated and scored; a generate function that returns several
        samples for one (fan-out) adds them all to the group."""
        if self._one_request(group):
            samples = await self._group(group)
        else:
            outputs = await asyncio.gather(*(self._one(s) for s in group))
            samples = [s for out in outputs for s in (out if isinstance(out, list) else [out])]
        if self.group_score is not None:  # rl-sglang's guard never saw these samples
            await self.group_score.score(samples)
        return samples

    def _one_request(self, group: list[Sample]) -> bool:
        """The default generate function on a fresh group: one request with n samples."""
        fits = len(group) <= self.config.max_concurrency
        wanted = self.config.group_requests
        return wanted and self.generate is generate_sample and fits and fresh_group(group)

    async def _group(self, group: list[Sample]) -> list[Sample]:
        taken = 0
        try:
            async with self._acquiring:
                for _ in group:
                    await self.semaphore.acquire()
                    taken += 1
            await self._generate_group(group)
        finally:
            for _ in range(taken):
                self.semaphore.release()
        await self._score(group)
        return group

    async def _generate_group(self, group: list[Sample]) -> None:
        def attempt():
            rid = uuid.uuid4().hex  # fresh per attempt: a retry never collides with a rid
            for i, sample in enumerate(group):  # the engine names sample i "<rid>-<i>"
                sample.metadata["rid"] = f"{rid}-{i}"
            return generate_group(self.ctx, group, self.config.sampling_params, rid=rid)

        await self._with_retries(group, attempt)

    async def _with_retries(self, samples: list[Sample], attempt) -> object:
        """``await attempt()``; on a retryable failure restore ``samples`` and try again.
        The last failure leaves them aborted with the error (never dropped silently)."""
        before = [_snapshot(s) for s in samples]
        for number in range(self.config.max_retries + 1):
            try:
                return await attempt()
            except Exception as error:  # classified below, kept on the sample
                for sample, state in zip(samples, before, strict=True):
                    _restore(sample, state)
                if not retryable(error) or number == self.config.max_retries:
                    for sample in samples:
                        sample.status = SampleStatus.ABORTED
                        sample.metadata["error"] = f"{type(error).__name__}: {error}"
                    return None
                self.counts["generate_retries"] += 1
                await asyncio.sleep(self.config.retry_backoff_s * 2**number)
        return None

    async def _score(self, samples: list[Sample]) -> None:
        """Rewards of the samples that were not aborted, concurrently; see RolloutConfig.
        A group reward scores the whole group in :meth:`run` instead."""
        if self.group_score is not None:
            return
        scored = [s for s in samples if s.status is not SampleStatus.ABORTED]
        await asyncio.gather(*(self.guard.score(s) for s in scored))

    async def _one(self, sample: Sample) -> Sample | list[Sample]:
        if sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED):
            return sample  # finished before its group was aborted; already scored

        def attempt():
            sample.metadata["rid"] = uuid.uuid4().hex
            return self.generate(self.ctx, sample, self.config.sampling_params)

        async with self.semaphore:
            result = await self._with_retries([sample], attempt)
        if result is None:
            return sample
        await self._score(result if isinstance(result, list) else [result])
        return result


_STATE_FIELDS = (
    "tokens",
    "response",
    "response_length",
    "loss_mask",
    "rollout_log_probs",
    "weight_versions",
    "status",
    "routed_experts",
)


def _snapshot(sample: Sample) -> dict:
    state = {name: copy.copy(getattr(sample, name)) for name in _STATE_FIELDS}
    return state | {"metadata": dict(sample.metadata)}


def _restore(sample: Sample, state: dict) -> None:
    for name, value in state.items():
        setattr(sample, name, copy.copy(value))


def retryable(error: BaseException) -> bool:
    """Connection failures, timeouts and 5xx: the engine (or the router's path to it) was
    lost, the request itself was fine. A 4xx is the request's fault: not retried."""
    if isinstance(error, EngineError):
        return error.status >= 500
    return isinstance(error, aiohttp.ClientError | TimeoutError | ConnectionError)


def make_groups(prompts: Iterator[Sample], n: int, start_index: int) -> Iterator[list[Sample]]:
    """Each prompt template becomes a group of n fresh copies with group/sample indices; a
    template with ``metadata["sampling_seed"]`` = S gives copy ``i`` the seed S + i."""
    for group_index, template in enumerate(prompts, start=start_index):
        group = []
        seed = template.metadata.get("sampling_seed")
        for i, sample in enumerate(_copies(template, n)):
            sample.group_index, sample.index = group_index, group_index * n + i
            if seed is not None:
                sample.metadata["sampling_seed"] = int(seed) + i
            group.append(sample)
        yield group


def _copies(template: Sample, n: int) -> list[Sample]:
    """``n`` independent deep copies; one pickle loaded n times is several times faster than
    n ``deepcopy`` calls (a rollout makes batch x group copies), deepcopy if unpicklable."""
    try:
        state = pickle.dumps(template, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        return [copy.deepcopy(template) for _ in range(n)]
    return [pickle.loads(state) for _ in range(n)]


async def default_rollout(
    ctx: GenerateContext,
    prompts: Iterator[Sample],
    reward_fn: RewardFn,
    config: RolloutConfig,
    *,
    engines: Sequence[EngineClient] = (),
    resume: Sequence[list[Sample]] = (),
) -> RolloutResult:
    """One rollout batch. ``engines`` (direct engine clients) receive the abort of the
    leftovers once the batch is full; ``resume`` are leftover groups of the last rollout."""
    runner = _GroupRunner(ctx, reward_fn, config)
    keep = GROUP_FILTERS.get(config.group_filter or "keep_all")
    source = itertools.chain(iter(resume), make_groups(prompts, config.n_samples_per_prompt, 0))
    max_in_flight = max(
        config.num_groups, -(-config.max_concurrency // config.n_samples_per_prompt)
    )
    pending: set[asyncio.Task] = set()
    kept, leftovers, counts = [], [], {"dropped": 0, "launched": 0, "dropped_reward": 0}

    def launch() -> None:
        while len(pending) < max_in_flight:  # over-sample: more groups than still needed
            group = next(source, None)
            if group is None:
                return
            counts["launched"] += 1
            pending.add(asyncio.ensure_future(runner.run(group)))

    launch()
    while pending and len(kept) < config.num_groups:
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            pending.discard(task)
            _sort_group(task.result(), keep, config, kept, leftovers, counts)
        if len(kept) < config.num_groups:
            launch()
    if pending:  # the batch is full: stop the rest, keep their partial responses
        await _abort_until_done(pending, engines)
        for group in await asyncio.gather(*pending):
            leftovers.append(group)
    extra, kept = kept[config.num_groups :], kept[: config.num_groups]
    leftovers.extend(extra)
    counts |= runner.counts | runner.guard.counts
    return RolloutResult(kept, _for_resume(leftovers, config), _metrics(kept, counts, leftovers))


async def _abort_until_done(
    pending: set[asyncio.Task], engines: Sequence[EngineClient], every_s: float = 0.5
) -> None:
    """Abort the engines' requests until every pending group has returned. One abort is
    not enough: a request still on its way (sent, not yet admitted by the engine) misses
    it and would run to its full length."""
    waiting = set(pending)
    while waiting:
        await asyncio.gather(*(engine.abort() for engine in engines))
        if not engines:
            return
        _, waiting = await asyncio.wait(waiting, timeout=every_s)


def _sort_group(group, keep, config, kept, leftovers, counts) -> None:
    if any(s.status is SampleStatus.ABORTED for s in group):
        leftovers.append(group)
    elif any(s.metadata.get("reward_dropped") for s in group):
        counts["dropped_reward"] += 1
    elif keep([scalar_reward(s, config.reward_key, unscored=0.0) for s in group]):
        kept.append(group)
    else:
        counts["dropped"] += 1


def _for_resume(leftovers: list[list[Sample]], config: RolloutConfig) -> list[list[Sample]]:
    """Leftovers to hand to the next rollout: with partial rollout, aborted samples keep
    their partial response; otherwise they are dropped back to fresh prompts."""
    if config.partial_rollout:
        return leftovers
    fresh = []
    for group in leftovers:
        for sample in group:
            sample.tokens = sample.tokens[: sample.prompt_length]
            sample.response_length, sample.loss_mask, sample.rollout_log_probs = 0, None, None
            sample.weight_versions, sample.status = [], SampleStatus.PENDING
        fresh.append(group)
    return fresh


def _metrics(kept, counts, leftovers) -> dict[str, float]:
    samples = [s for g in kept for s in g]
    lengths = [s.response_length for s in samples] or [0]
    return {
        "rollout/groups_launched": float(counts["launched"]),
        "rollout/groups_dropped": float(counts["dropped"]),
        "rollout/groups_left_over": float(len(leftovers)),
        "rollout/groups_dropped_reward_error": float(counts["dropped_reward"]),
        "rollout/generate_retries": float(counts["generate_retries"]),
        "rollout/reward_errors": float(counts["reward_errors"]),
        "rollout/reward_timeouts": float(counts["reward_timeouts"]),
        "rollout/truncated_frac": sum(s.status is SampleStatus.TRUNCATED for s in samples)
        / max(len(samples), 1),
        "rollout/response_length_mean": sum(lengths) / len(lengths),
    }
