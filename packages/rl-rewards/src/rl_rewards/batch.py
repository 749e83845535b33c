"""Score many samples with a per-sample timeout; a raising or hung reward never stalls a batch.

With ``workers >= 1`` each sample runs in one of ``workers`` processes (forkserver,
:class:`rl_rewards.workers.Worker`); a sample that passes its deadline gets its process
killed and replaced, so even a sympy call stuck in C code or an infinite loop is cut off.
With ``workers == 0`` samples run in this process and the timeout is a ``SIGALRM`` timer
(main thread on Unix only; elsewhere no timeout).
"""

from __future__ import annotations

import dataclasses
import math
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from rl_rewards.registry import RewardFn
from rl_rewards.workers import Outcome, RewardRef, Worker, call, resolve_reward, worker_context

__all__ = [
    "BatchReport",
    "RewardRef",
    "ScoreResult",
    "call_reward",
    "resolve_reward",
    "score_batch",
]
ON_FAILURE = ("zero", "drop")


@dataclass(frozen=True)
class ScoreResult:
    """One sample's outcome: ``status`` is ok | error | timeout; unless ok, the score is
    0.0, or None when the batch drops failed samples (``on_failure="drop"``)."""

    score: float | None
    status: str = "ok"
    reason: str = ""


@dataclass
class BatchReport:
    """All results in input order, with the counts of errors and timeouts."""

    results: list[ScoreResult] = field(default_factory=list)

    @property
    def num_errors(self) -> int:
        return sum(r.status == "error" for r in self.results)

    @property
    def num_timeouts(self) -> int:
        return sum(r.status == "timeout" for r in self.results)

    @property
    def num_dropped(self) -> int:
        return sum(r.score is None for r in self.results)

    @property
    def scores(self) -> list[float | None]:
        return [r.score for r in self.results]

    @property
    def kept(self) -> list[int]:
        """Indices of the samples that have a score (all but the dropped ones)."""
        return [i for i, r in enumerate(self.results) if r.score is not None]


def call_reward(fn: RewardFn, response: str, label: Any) -> ScoreResult:
    """Run one reward; an exception or a non-finite / non-numeric score becomes an error."""
    return _score_result(call(fn, response, label))


def _score_result(outcome: Outcome) -> ScoreResult:
    """A call's outcome as a score: anything but a finite number is an error scoring 0."""
    value = outcome.value
    if outcome.status != "ok":
        return ScoreResult(0.0, outcome.status, outcome.reason)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return ScoreResult(0.0, "error", f"reward returned {value!r}, not a finite number")
    return ScoreResult(float(value))


class _Alarm(BaseException):  # not an Exception: call_reward must not swallow it
    pass


def _raise_alarm(signum, frame):
    raise _Alarm


def _call_with_alarm(fn: RewardFn, response: str, label: Any, timeout_s: float) -> ScoreResult:
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "setitimer"
    ):
        return call_reward(fn, response, label)
    previous = signal.signal(signal.SIGALRM, _raise_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return call_reward(fn, response, label)
    except _Alarm:
        return ScoreResult(0.0, "timeout", f"exceeded {timeout_s:g} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _Pool:
    """Worker processes fed chunks of samples; a worker that shows no progress for
    ``timeout_s`` is killed, its current sample recorded as a timeout, and the rest of its
    chunk requeued. (A sample may so run up to ``timeout_s`` plus the 50 ms a result may
    wait to be sent; a new worker's clock starts once it has loaded the reward.)"""

    def __init__(self, tasks, reward, options, workers, timeout_s, record, chunk_size):
        self.tasks, self.pending = tasks, deque(range(len(tasks)))
        self.reward, self.options, self.timeout_s, self.record = reward, options, timeout_s, record
        self.chunk_size, self.ctx = chunk_size, worker_context()
        self.pool = [self._new_worker() for _ in range(min(workers, len(tasks)))]

    def _new_worker(self) -> Worker:
        return Worker(self.ctx, self.reward, self.options)

    def run(self) -> None:
        try:
            while self.pending or any(w.owed for w in self.pool):
                self._feed()
                wait_s = max(0.0, min(w.deadline for w in self.pool) - time.monotonic())
                wait([w.conn for w in self.pool if not w.broken], timeout=wait_s)
                for slot, worker in enumerate(self.pool):
                    for index, outcome in worker.collect():
                        self.record(index, _score_result(outcome))
                    if worker.broken:  # finished but unsent ones are scored again
                        self.pending.extendleft(reversed(worker.owed))
                        self.pool[slot] = self._new_worker()
        finally:
            for worker in self.pool:
                if not worker.broken:
                    worker.stop(kill=bool(worker.owed))

    def _feed(self) -> None:
        for worker in self.pool:
            if not worker.owed and self.pending:
                take = min(self.chunk_size, len(self.pending))
                chunk = [self.tasks[self.pending.popleft()] for _ in range(take)]
                worker.send(chunk, self.timeout_s)


def score_batch(
    reward: RewardRef,
    responses: Sequence[str],
    labels: Sequence[Any],
    *,
    options: dict[str, Any] | None = None,
    workers: int = 0,
    timeout_s: float = 10.0,
    on_result: Callable[[int, ScoreResult], None] | None = None,
    on_failure: str = "zero",
) -> BatchReport:
    """Score ``responses[i]`` against ``labels[i]`` for every i; results keep input order.

    ``reward`` is a registered name or dotted path (``options`` bound to it), or a picklable
    callable. ``on_result(i, result)`` is called as each sample finishes (for progress bars).
    A sample whose reward raised, hung past ``timeout_s`` or returned NaN/inf/non-numbers
    scores 0.0 (``on_failure="zero"``) or None (``"drop"``: leave it out, see
    :attr:`BatchReport.kept`); either way it is counted and the batch goes on.
    """
    if on_failure not in ON_FAILURE:
        raise ValueError(f"on_failure must be one of {ON_FAILURE}, got {on_failure!r}")
    if len(responses) != len(labels):
        raise ValueError(
            f"{len(responses)} responses but {len(labels)} labels; pass one label each"
        )
    if workers < 0 or timeout_s <= 0:
        raise ValueError(f"need workers >= 0 and timeout_s > 0, got {workers} and {timeout_s}")
    results: list[ScoreResult | None] = [None] * len(responses)

    def record(index: int, result: ScoreResult) -> None:
        if result.status != "ok" and on_failure == "drop":
            result = dataclasses.replace(result, score=None)
        results[index] = result
        if on_result is not None:
            on_result(index, result)

    fn = resolve_reward(reward, options)  # validates the name before any process starts
    if workers == 0:
        for index, (response, label) in enumerate(zip(responses, labels, strict=True)):
            record(index, _call_with_alarm(fn, response, label, timeout_s))
    else:
        tasks = [(i, r, lab) for i, (r, lab) in enumerate(zip(responses, labels, strict=True))]
        chunk_size = max(1, min(64, len(tasks) // (4 * workers)))
        _Pool(tasks, reward, options, workers, timeout_s, record, chunk_size).run()
    return BatchReport([r for r in results if r is not None])
