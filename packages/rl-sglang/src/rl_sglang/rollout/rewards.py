"""Scoring one sample so that a bad reward function is handled as configured.

    guard = RewardGuard(reward_fn, timeout_s=10, on_error="zero")
    await guard.score(sample)   # sample.reward set; failures counted in guard.counts

A reward that raises, returns a non-finite number (NaN, inf, in a dict too) or a non-number,
or, with ``timeout_s``, takes longer, is handled per ``on_error``:

- ``"raise"`` (default): the exception propagates, with a note naming the reward and the
  sample (NaN and timeouts as :class:`RewardFailed`, whose message names them and the
  option), and the rollout stops.
- ``"zero"``: ``sample.reward = 0.0`` and ``sample.metadata["reward_error"]``; counted.
- ``"drop"``: reward None and ``sample.metadata["reward_dropped"]``; the rollout drops the
  group (over-sampling replaces it); counted.

With ``timeout_s`` a synchronous reward runs in its own daemon thread, since a hung call
cannot be interrupted on the event loop; a thread that never returns is left behind (Python
cannot kill threads), and one spinning while it holds the GIL slows the event loop down.
For rewards that may hang for good, score in processes that can be killed: pass a
coroutine function that awaits ``rl_rewards.pool.RewardPool.score`` (as the launcher
does) and leave ``timeout_s`` to the pool. A coroutine function is awaited on the event
loop, under ``timeout_s``.
"""

import asyncio
import contextlib
import inspect
import math
import queue
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rl_core.types import Sample

REWARD_ON_ERROR = ("raise", "zero", "drop")


@dataclass(frozen=True)
class GroupScore:
    """A reward of whole groups: ``await score(samples)`` sets the ``reward`` of every
    unaborted sample of a prompt's group once all of them have finished (handling its own
    failures). Passed as the rollout's ``reward_fn``, it replaces per-sample scoring."""

    score: Callable[[list[Sample]], Awaitable[None]]


class RewardFailed(ValueError):
    """A reward returned an unusable value or timed out (``on_error="raise"``)."""


class RewardGuard:
    def __init__(self, reward_fn: Callable, timeout_s: float | None, on_error: str = "raise"):
        if on_error not in REWARD_ON_ERROR:
            raise ValueError(f"reward_on_error must be one of {REWARD_ON_ERROR}, got {on_error!r}")
        self.reward_fn, self.timeout_s, self.on_error = reward_fn, timeout_s, on_error
        self.name = reward_name(reward_fn)
        self.counts = {"reward_errors": 0, "reward_timeouts": 0}

    async def score(self, sample: Sample) -> None:
        try:
            value = await self._call(sample)
        except TimeoutError:
            limit = f"timeout: no reward within reward_timeout_s={self.timeout_s:g} s"
            self._fail(sample, "reward_timeouts", limit)
            return
        except Exception as error:  # a reward's failure is data here: counted, kept
            if self.on_error == "raise":
                error.add_note(f"in reward {self.name!r} on sample {sample.index}")
                raise
            self._fail(sample, "reward_errors", f"error: {type(error).__name__}: {error}"[:500])
            return
        reason = bad_reward(value)
        if reason is not None:
            self._fail(sample, "reward_errors", reason)
            return
        sample.reward = value

    async def _call(self, sample: Sample):
        if self.timeout_s is None:
            value = self.reward_fn(sample)
            return await value if inspect.isawaitable(value) else value
        return await asyncio.wait_for(self._threaded(sample), self.timeout_s)

    async def _threaded(self, sample: Sample):
        if inspect.iscoroutinefunction(self.reward_fn):
            return await self.reward_fn(sample)
        value = await REWARD_THREADS.submit(self.reward_fn, sample)
        return await value if inspect.isawaitable(value) else value

    def _fail(self, sample: Sample, counter: str, reason: str) -> None:
        self.counts[counter] += 1
        if self.on_error == "raise":
            raise RewardFailed(
                f"reward {self.name!r} on sample {sample.index}: {reason} (reward_on_error="
                "'raise' stops the rollout; 'zero' or 'drop' counts such samples and goes on)"
            )
        sample.metadata["reward_error"] = reason
        if self.on_error == "zero":
            sample.reward = 0.0
        else:
            sample.reward = None
            sample.metadata["reward_dropped"] = True


class DaemonThreads:
    """Daemon threads that run calls handed to them from event loops, reused: a call
    starts a new thread only when none is idle (a thread that never returns stays busy for
    good, and the next call gets a new one). Daemon threads, unlike ``asyncio.to_thread``'s:
    a call that never returns blocks neither the loop's shutdown nor the interpreter's exit. Starting a thread per call cost the rollout's
    event loop 0.15-0.4 s of CPU per 1,024 samples on a 2-core machine, and each start
    waits for the new thread to take the GIL from whatever else runs in the process."""

    def __init__(self, name: str = "reward"):
        self.name = name  # of its threads
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args) -> asyncio.Future:
        """``fn(*args)`` on one of the threads; the future resolves on the caller's loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            start = self._idle == 0
            self._idle -= 0 if start else 1  # an idle thread is now taken
        self._jobs.put((fn, args, loop, future))
        if start:
            threading.Thread(target=self._serve, name=self.name, daemon=True).start()
        return future

    def _serve(self) -> None:
        while True:
            fn, args, loop, future = self._jobs.get()
            try:
                outcome = (fn(*args), None)
            except Exception as error:  # handed to the awaiting coroutine
                outcome = (None, error)
            with self._lock:  # idle before the caller hears back: its next call reuses us
                self._idle += 1
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, future, *outcome)
            del fn, args, loop, future, outcome  # hold nothing while idle


def _settle(future: asyncio.Future, value, error) -> None:
    if not future.done():  # cancelled by a timeout meanwhile
        future.set_exception(error) if error is not None else future.set_result(value)


REWARD_THREADS = DaemonThreads()  # every RewardGuard's synchronous rewards under a timeout


def reward_name(fn: Callable) -> str:
    """What messages call ``fn``: the ``name`` of its object (the launcher's rewards have
    one; for a bound method, its object's), else its qualified name."""
    named = getattr(getattr(fn, "__self__", fn), "name", None)
    if isinstance(named, str):
        return named
    fn = getattr(fn, "func", fn)  # a functools.partial names its function
    return getattr(fn, "__qualname__", None) or repr(fn)


def bad_reward(value) -> str | None:
    """Why ``value`` (a number, or a dict whose numbers are checked) is unusable, or None."""
    if isinstance(value, dict):
        numbers = [v for v in value.values() if isinstance(v, int | float)]
    elif isinstance(value, int | float):
        numbers = [value]
    else:
        return f"not a number: reward returned {value!r:.100}"
    bad = [v for v in numbers if not math.isfinite(v)]
    return f"non-finite: reward returned {value!r:.200}" if bad else None
