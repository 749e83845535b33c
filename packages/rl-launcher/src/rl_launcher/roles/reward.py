"""The run's reward: an rl-rewards name or a dotted path, called per sample.

The reward sees the response decoded without special tokens (an EOS is not part of the
answer) and the sample's label. With ``rollout.reward_timeout_s`` set, a synchronous reward
runs in reward worker processes (:class:`rl_rewards.pool.RewardPool`: started once per
run, :func:`rl_rewards.pool.default_workers` of them, each importing the reward by its
name): a call that passes the limit, whatever it is doing, gets its process killed and
replaced, and the rollout's event loop never waits on one. A reward written as a coroutine
function stays on the event loop, under the same limit. Without a limit, rewards run in
this process, as they are.

A reward that raises, passes the limit or returns something other than a finite number (or
a mapping holding them) either stops the run with the reward's name, the sample and what
went wrong (``on_error="raise"``: :class:`RewardError`, ``rl-train`` exits with status 2),
or (``on_error="skip"``) marks the sample aborted with that message in its metadata, so it
is left out of training (its group trains on the samples that scored:
:mod:`rl_launcher.data.buffer`), and counts it (:meth:`Reward.take_counts`:
``rollout/reward_errors``, ``rollout/reward_timeouts``); never a silent 0. A mapping reward
needs ``algorithm.reward_key`` to name one of its keys.

A reward whose first parameter is named ``sample`` gets the whole Sample (its worker
processes get it pickled); ``rollout.reward_options`` are bound as keyword options either
way. A group reward (``rollout.group_reward``, :class:`GroupReward`) scores a prompt's
whole group in one call, under the same time limit and error handling.
"""

import asyncio
import functools
import inspect
import logging
import threading
from typing import Any

from rl_core.registry import load_dotted
from rl_core.types import Sample, SampleStatus
from rl_launcher.config.extensions import takes_sample
from rl_sglang.detokenize import text_decoder
from rl_sglang.rollout.rewards import GroupScore, bad_reward

logger = logging.getLogger(__name__)
ON_ERROR = ("raise", "skip")
COUNTS = ("reward_errors", "reward_timeouts")  # metrics rollout/<name>, per step
_LOGGED = 10  # skipped failures logged per run; the rest are only counted


class RewardError(RuntimeError):
    """A reward function failed on a sample and ``rollout.on_reward_error`` is raise."""


class Reward:
    """``reward(sample) -> float | dict`` of one reward function (see the module docstring);
    :attr:`rollout_fn` is what the rollout calls."""

    def __init__(
        self,
        name: str,
        score,
        tokenizer: Any,
        *,
        on_error: str = "raise",
        timeout_s: float | None = None,
        pool=None,
        reward_key: str | None = None,
        owns_pool: bool = True,
    ):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}; choose one of {ON_ERROR}")
        self.name, self.score, self.tokenizer, self.on_error = name, score, tokenizer, on_error
        self.timeout_s, self.pool, self.reward_key = timeout_s, pool, reward_key
        self.owns_pool = owns_pool
        self.counts, self.num_skipped = dict.fromkeys(COUNTS, 0), 0
        self._lock = threading.Lock()  # counted on the rollout's event loop, taken by the driver
        self.takes_sample = takes_sample(score)
        self._decode = text_decoder(tokenizer)

    def _arguments(self, sample: Sample, text: str) -> tuple:
        """What the reward function is called with: the sample, or (response, label)."""
        return (sample,) if self.takes_sample else (text, sample.label)

    @property
    def rollout_fn(self):
        """What rl-sglang's rollout calls: this object, or the coroutine :meth:`ascore` when
        the reward runs in worker processes or is itself a coroutine function."""
        if self.pool is not None or inspect.iscoroutinefunction(self.score):
            return self.ascore
        return self

    def __call__(self, sample: Sample) -> float | dict:
        """Score ``sample`` in this process."""
        text = self.decode(sample)
        try:
            value = self.score(*self._arguments(sample, text))
        except Exception as error:  # re-raised with context or counted, never swallowed
            return self._failed(sample, text, "failed", f": {_described(error)}", error)
        return self._checked(sample, text, value)

    async def ascore(self, sample: Sample) -> float | dict:
        """Score ``sample`` in a worker process, or await the coroutine reward, within
        ``timeout_s``."""
        text = self.decode(sample)
        if self.pool is not None:
            outcome = await self.pool.score(*self._pool_arguments(sample, text))
            if outcome.status == "timeout":
                return self._timed_out(
                    sample, text, f"; its worker process was killed ({outcome.reason})"
                )
            if outcome.status != "ok":
                return self._failed(sample, text, "failed", f": {outcome.reason}")
            return self._checked(sample, text, outcome.value)
        try:
            async with asyncio.timeout(self.timeout_s) as limit:
                value = await self.score(*self._arguments(sample, text))
        except Exception as error:  # a timeout, or the reward's own error
            if limit.expired():
                return self._timed_out(sample, text, "; it was cancelled", error)
            return self._failed(sample, text, "failed", f": {_described(error)}", error)
        return self._checked(sample, text, value)

    def _pool_arguments(self, sample: Sample, text: str) -> tuple:
        """A worker calls ``fn(response, label)``: a sample reward's worker function
        (:func:`score_sample`) takes the sample in the response's place."""
        return (sample, None) if self.takes_sample else (text, sample.label)

    def decode(self, sample: Sample) -> str:
        response_ids = sample.tokens[sample.prompt_length :]
        return self._decode(response_ids, skip_special_tokens=True)

    def _checked(self, sample: Sample, text: str, value) -> float | dict:
        """``value`` when usable: a finite number, or a mapping of them with ``reward_key``."""
        scalar = value
        if isinstance(value, dict):
            if self.reward_key not in value:
                raise ValueError(
                    f"reward {self.name!r} returned a mapping with keys {sorted(map(str, value))}; "
                    "set algorithm.reward_key to the one to train on"
                )
            scalar = value[self.reward_key]
        if bad_reward(value) is None and bad_reward(scalar) is None:
            return value
        return self._failed(sample, text, f"returned {value!r:.200}", ", not a finite number")

    def _timed_out(self, sample: Sample, text: str, detail: str, error=None) -> float:
        problem = f"took longer than rollout.reward_timeout_s={self.timeout_s:g} s"
        return self._failed(sample, text, problem, detail, error, counter="reward_timeouts")

    def _failed(
        self,
        sample: Sample,
        text: str,
        problem: str,
        detail: str,
        error=None,
        *,
        counter: str = "reward_errors",
    ) -> float:
        message = (
            f"reward {self.name!r} {problem} on sample {sample.index} "
            f"(response {text!r:.200}, label {sample.label!r:.100}){detail}"
        )
        if self.on_error == "raise":
            raise RewardError(message) from error
        with self._lock:
            self.counts[counter] += 1
            self.num_skipped += 1
            if self.num_skipped <= _LOGGED:
                logger.warning("%s; sample skipped (rollout.on_reward_error=skip)", message)
        sample.status = SampleStatus.ABORTED
        sample.metadata["reward_error"] = message
        return 0.0

    def count(self, name: str, number: int) -> None:
        """Add ``number`` failures of kind ``name`` (:data:`COUNTS`) counted elsewhere."""
        with self._lock:
            self.counts[name] += number

    def take_counts(self) -> dict[str, int]:
        """Skipped failures of each kind (:data:`COUNTS`) since the last call."""
        with self._lock:
            counts, self.counts = self.counts, dict.fromkeys(COUNTS, 0)
        return counts

    def sharing(self) -> "Reward":
        """The same reward under the same settings and worker processes, counting its own
        failures (evaluation beside the rollout); its :meth:`close` leaves the processes."""
        return Reward(
            self.name,
            self.score,
            self.tokenizer,
            on_error=self.on_error,
            timeout_s=self.timeout_s,
            pool=self.pool,
            reward_key=self.reward_key,
            owns_pool=False,
        )

    def close(self) -> None:
        """Stop the worker processes, if any and if this reward started them."""
        if self.pool is not None and self.owns_pool:
            self.pool.close()


def _described(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:500]


def score_sample(name: str, options: dict, sample: Sample, _label: Any = None):
    """A worker process's call of a sample reward: ``fn(sample, **options)``."""
    from rl_rewards import get_reward

    return get_reward(name, **options)(sample)


def load_reward(
    name: str,
    tokenizer: Any,
    *,
    on_error: str = "raise",
    timeout_s: float | None = None,
    reward_key: str | None = None,
    options: dict | None = None,
) -> Reward:
    """The reward ``name`` (rl-rewards registry or ``pkg.mod:fn``) with ``options`` bound,
    as ``fn(sample)``; with ``timeout_s``, a synchronous one gets its worker processes now
    (module docstring)."""
    from rl_rewards import get_reward
    from rl_rewards.pool import RewardPool

    options = dict(options or {})
    score = get_reward(name, **options)
    pool = None
    if timeout_s is not None and not inspect.iscoroutinefunction(score):
        if takes_sample(score):
            worker_fn = functools.partial(score_sample, name, options)
            pool = RewardPool(worker_fn, timeout_s=timeout_s)
        else:
            pool = RewardPool(name, timeout_s=timeout_s, options=options or None)
    return Reward(
        name,
        score,
        tokenizer,
        on_error=on_error,
        timeout_s=timeout_s,
        pool=pool,
        reward_key=reward_key,
    )


class GroupReward(Reward):
    """``rollout.group_reward``: ``fn(samples) -> list[float]`` over a prompt's finished,
    unaborted samples, awaited (a coroutine function) or run in a thread, within
    ``timeout_s``; failures handled per ``on_error`` for every sample of the call."""

    def __init__(self, name: str, tokenizer: Any, **settings):
        super().__init__(name, load_dotted(name), tokenizer, **settings)

    @property
    def rollout_fn(self) -> GroupScore:
        return GroupScore(self.score_group)

    async def score_group(self, samples: list[Sample]) -> None:
        live = [s for s in samples if s.status is not SampleStatus.ABORTED]
        if not live:
            return
        texts = [self.decode(s) for s in live]
        try:
            async with asyncio.timeout(self.timeout_s) as limit:
                values = await self._call(live)
        except Exception as error:  # a timeout, or the reward's own error
            if limit.expired():
                for sample, text in zip(live, texts, strict=True):
                    self._timed_out(sample, text, "; it was cancelled", error)
                return
            for sample, text in zip(live, texts, strict=True):
                self._failed(sample, text, "failed", f": {_described(error)}", error)
            return
        if not isinstance(values, list | tuple) or len(values) != len(live):
            problem = f"returned {values!r:.200} for {len(live)} samples"
            for sample, text in zip(live, texts, strict=True):
                self._failed(sample, text, problem, ", not one number per sample")
            return
        for sample, text, value in zip(live, texts, values, strict=True):
            checked = self._checked(sample, text, value)
            if sample.status is not SampleStatus.ABORTED:
                sample.reward = checked

    async def _call(self, samples: list[Sample]):
        if inspect.iscoroutinefunction(self.score):
            return await self.score(samples)
        return await asyncio.to_thread(self.score, samples)

    def sharing(self) -> "GroupReward":
        raise NotImplementedError("evaluation scores samples one by one: use rollout.reward")


def load_run_reward(config, tokenizer) -> Reward:
    """The run's reward: ``rollout.group_reward`` when set, else ``rollout.reward`` with
    ``rollout.reward_options``; both under the run's time limit and error handling."""
    rollout = config.rollout
    settings = {
        "on_error": rollout.on_reward_error,
        "timeout_s": rollout.reward_timeout_s,
        "reward_key": config.algorithm.reward_key,
    }
    if rollout.group_reward is not None:
        return GroupReward(rollout.group_reward, tokenizer, **settings)
    return load_reward(rollout.reward, tokenizer, options=rollout.reward_options, **settings)
