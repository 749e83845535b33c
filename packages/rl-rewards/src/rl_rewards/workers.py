"""Reward calls in processes that can be killed: a reward stuck for good (a busy loop, a
regex or sympy call deep in C code holding the GIL) costs its own call, never the caller.

Each process imports the reward by name (an rl-rewards name or ``pkg.module:function``,
looked up on the parent's ``sys.path``) and says when it has: a call's clock starts when a
loaded process takes it, so queueing and loading never count against ``timeout_s``. A call
past its deadline gets its process killed and replaced (the new one imports the reward
again). :class:`Worker` is one process as its parent sees it, shared by
:class:`rl_rewards.pool.RewardPool` (long-lived, one chunk of calls per process at a
time, for a training run) and :func:`rl_rewards.batch.score_batch` (one batch, in chunks).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import signal
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from rl_rewards.registry import RewardFn, get_reward

RewardRef = str | RewardFn  # a registered name / dotted path, or a picklable callable
STARTUP_S = 60.0  # for a process to load its reward; past it, its first call fails
_FLUSH_S = 0.05
_PRELOAD = ["rl_rewards.math.reward", "rl_rewards.math.latex", "rl_rewards.qa", "rl_rewards.choice"]


@dataclass(frozen=True)
class Outcome:
    """One call: ``status`` ok (``value`` is what the reward returned) | error | timeout,
    with ``reason`` saying why unless ok."""

    value: Any = None
    status: str = "ok"
    reason: str = ""


def resolve_reward(reward: RewardRef, options: dict[str, Any] | None = None) -> RewardFn:
    """A callable from a name / dotted path (with ``options`` bound) or a callable as is."""
    if isinstance(reward, str):
        return get_reward(reward, **(options or {}))
    if options:
        raise ValueError("options are only accepted with a reward given by name")
    return reward


def call(fn: RewardFn, response: str, label: Any) -> Outcome:
    """``fn(response, label)``; an exception becomes an error outcome naming its type."""
    try:
        return Outcome(fn(response, label))
    except Exception as exc:  # a reward's failure is data here: recorded, never raised
        return Outcome(None, "error", f"{type(exc).__name__}: {exc}"[:500])


def worker_context():
    """forkserver where there is one (cheap starts, modules preloaded once), else spawn;
    never fork: the parent runs threads (an event loop, Ray, HTTP clients)."""
    ctx = multiprocessing.get_context(
        "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    )
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker_main(conn, current, reward: RewardRef, options) -> None:
    """Load the reward, say so (an empty list), then score chunks of (index, response,
    label) until told to stop or the parent is gone. Results go back in small batches (at
    least every ``_FLUSH_S``), so the parent sees progress often enough to time out a stuck
    call, at little pipe cost. ``current`` (shared memory) holds the index being scored, so
    the parent knows which call to blame if this process hangs or dies with results not
    yet sent. (``sys.path`` is the parent's: multiprocessing hands it over.)"""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not a parent's handler, if forked
    fn, failed = None, None
    try:
        fn = resolve_reward(reward, options)
    except Exception as exc:  # every call reports it, so the parent hears why
        failed = Outcome(None, "error", f"cannot load the reward in a worker: {exc}")
    conn.send([])
    with contextlib.suppress(EOFError):
        while (chunk := conn.recv()) is not None:
            done, last_flush = [], time.monotonic()
            for index, response, label in chunk:
                current.value = index
                done.append((index, failed or call(fn, response, label)))
                if time.monotonic() - last_flush > _FLUSH_S:
                    conn.send(done)
                    done, last_flush = [], time.monotonic()
            if done:
                conn.send(done)


class Worker:
    """One reward process seen from the parent: the indices it owes, in order, and its
    deadline: ``startup_s`` to load the reward, then ``timeout_s`` from the start of each
    call (from the last result, within a chunk); none while idle. A worker that is
    overdue or dead is killed and marked ``broken``: the caller re-sends what it still
    ``owed`` to another worker."""

    def __init__(self, ctx, reward: RewardRef, options=None, *, startup_s: float = STARTUP_S):
        self.conn, child_conn = ctx.Pipe()
        self.current = ctx.Value("q", -1, lock=False)
        args = (child_conn, self.current, reward, options)
        self.process = ctx.Process(target=_worker_main, args=args, daemon=True)
        self.process.start()
        child_conn.close()
        self.owed: deque[int] = deque()
        self.ready = self.broken = False
        self.startup_s, self.timeout_s = startup_s, math.inf
        self.deadline = time.monotonic() + startup_s

    def send(self, chunk: list[tuple[int, str, Any]], timeout_s: float) -> None:
        self.owed.extend(index for index, _, _ in chunk)
        self.timeout_s = timeout_s
        if self.ready:
            self.deadline = time.monotonic() + timeout_s
        try:
            self.conn.send(chunk)
        except OSError:  # it died while idle (BrokenPipeError): no call to blame
            self.broken, self.deadline = True, 0.0
            self.stop(kill=True)

    def collect(self) -> list[tuple[int, Outcome]]:
        """The results that have arrived; if the process is overdue or dead, also its
        current call's failure (timeout or error)."""
        done: list[tuple[int, Outcome]] = []
        if self.broken:
            return done
        try:
            while self.conn.poll():
                for index, outcome in self.conn.recv():
                    assert index == self.owed.popleft()
                    done.append((index, outcome))
                self.ready = True  # its first message, empty, says it loaded the reward
                self.deadline = time.monotonic() + self.timeout_s if self.owed else math.inf
            if time.monotonic() < self.deadline:
                return done
            failed = self._overdue()
        except EOFError:
            self.process.join(timeout=5)
            failed = Outcome(None, "error", f"worker died (exit code {self.process.exitcode})")
        self.broken = True
        self.stop(kill=True)
        if self.owed:
            culprit = self.current.value if self.current.value in self.owed else self.owed[0]
            self.owed.remove(culprit)
            done.append((culprit, failed))
        return done

    def _overdue(self) -> Outcome:
        if not self.ready:
            return Outcome(
                None, "timeout", f"worker did not load the reward in {self.startup_s:g} s"
            )
        return Outcome(None, "timeout", f"exceeded {self.timeout_s:g} s")

    def stop(self, kill: bool) -> None:
        if not kill:
            try:
                self.conn.send(None)
            except OSError:  # already gone (BrokenPipeError): nothing to ask
                kill = True
        if kill:
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()
