"""A pool of reward processes for a whole run: a call that hangs for good, whatever it does,
costs its time limit and its process (killed and replaced), never the caller.

    with RewardPool("pkg.module:fn", timeout_s=10) as pool:    # processes start here
        outcome = pool.submit(response, label).result()         # or: await pool.score(...)
        outcome.status, outcome.value                           # ok | error | timeout

A call's clock starts when a process that has loaded the reward takes it
(:mod:`rl_rewards.workers`), so waiting in the queue never counts against ``timeout_s``;
calls queued behind hung ones wait for a free process: ``k`` hung calls among ``workers``
processes hold a batch up for about ``ceil(k / workers) * timeout_s``. While many calls
wait, a process takes several at once (:func:`chunk_size`), and the calls behind a hung one
in its chunk wait for its timeout before another process takes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import wait
from typing import Any

from rl_rewards.workers import Outcome, RewardRef, Worker, resolve_reward, worker_context


def default_workers() -> int:
    """Processes of a :class:`RewardPool` by default: half the CPUs this process may use,
    at least 2 (so one hung call never holds up all the others) and at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, min(8, (cpus or 1) // 2))


class RewardPool:
    """``workers`` reward processes (default :func:`default_workers`), started now and kept
    until :meth:`close`. Calls queue for a free process; each gets at most ``timeout_s``
    once one takes it. The processes belong to a broker process (:class:`_Broker`) that
    hands calls out, times them and replaces killed processes, so the round trips never wait
    for this process's GIL (a busy thread here held them up for up to 5 ms each); here a
    reader thread settles the futures, so no caller and no event loop ever blocks on a
    reward. Any thread or event loop may submit."""

    def __init__(
        self,
        reward: str,
        *,
        timeout_s: float,
        workers: int | None = None,
        options: dict[str, Any] | None = None,
    ):
        if timeout_s <= 0 or (workers is not None and workers < 1):
            raise ValueError(f"need timeout_s > 0 and workers >= 1, got {timeout_s}, {workers}")
        resolve_reward(reward, options)  # an unknown name fails here, not in every process
        self.num_workers, self.timeout_s = workers or default_workers(), timeout_s
        ctx = worker_context()
        calls_r, self._calls = ctx.Pipe(duplex=False)
        self._results, results_w = ctx.Pipe(duplex=False)
        args = (calls_r, results_w, reward, options, self.num_workers, timeout_s)
        self._broker = ctx.Process(target=_broker_main, args=args, daemon=True, name="reward-pool")
        self._broker.start()
        calls_r.close()
        results_w.close()
        self._futures: dict[int, Any] = {}  # index -> waiter (see _send)
        self._ids, self._lock, self._closing = itertools.count(), threading.Lock(), False
        self._outboxes: dict[asyncio.AbstractEventLoop, list] = {}  # score() calls to send
        self._reader = threading.Thread(target=self._read, name="reward-pool", daemon=True)
        self._reader.start()

    def submit(self, response: str, label: Any) -> Future:
        """A future of the call's :class:`Outcome` (RuntimeError if the pool closes first)."""
        future: Future = Future()
        future.set_running_or_notify_cancel()  # queued at once: no longer cancellable
        error = self._send([(response, label)], [future])
        if error is not None:
            raise error
        return future

    async def score(self, response: str, label: Any) -> Outcome:
        """The call's :class:`Outcome`, awaited on the running event loop. The calls a loop
        makes in one pass (a gathered group's samples) go to the broker as one message, and
        the results that arrive together settle in one callback on the loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            outbox = self._outboxes.setdefault(loop, [])
            outbox.append((response, label, future))
        if len(outbox) == 1:  # the first of this pass: send them all once the pass is over
            loop.call_soon(self._flush, loop)
        return await future

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            outbox = self._outboxes.pop(loop)
        waiters = [(loop, future) for _, _, future in outbox]
        error = self._send([(response, label) for response, label, _ in outbox], waiters)
        if error is not None:
            _settle(waiters, error)

    def _send(self, calls: list[tuple[str, Any]], waiters: list) -> RuntimeError | None:
        """Hand ``calls`` to the broker in one message, each settling its waiter (a
        Future, or a (loop, asyncio.Future) pair) when its outcome comes back; the error
        to raise if the pool stopped."""
        with self._lock:
            if self._closing:
                return RuntimeError(f"the reward pool stopped: {self._stopped()}")
            indices = [next(self._ids) for _ in calls]
            self._futures.update(zip(indices, waiters, strict=True))
            message = [(index, *call) for index, call in zip(indices, calls, strict=True)]
            try:
                self._calls.send(message)
            except OSError as error:  # the broker is gone; the reader fails the rest
                for index in indices:
                    del self._futures[index]
                stopped = RuntimeError(f"the reward pool stopped: {self._stopped()}")
                stopped.__cause__ = error
                return stopped
        return None

    def close(self) -> None:
        """Stop the processes (killing busy ones); calls not finished fail with RuntimeError."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            with contextlib.suppress(OSError):  # already gone
                self._calls.send(None)
        self._broker.join(timeout=30)
        if self._broker.exitcode is None:
            self._broker.kill()
            self._broker.join()
        self._reader.join()
        self._calls.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _read(self) -> None:
        """Settle futures as results arrive, until the broker is gone; then fail the rest."""
        with contextlib.suppress(EOFError):
            while True:
                results = self._results.recv()
                with self._lock:
                    waiters = [self._futures.pop(index) for index, _ in results]
                _settle(waiters, [outcome for _, outcome in results])
        with self._lock:
            self._closing, waiters, self._futures = True, list(self._futures.values()), {}
        self._results.close()
        _settle(waiters, RuntimeError(f"the reward pool stopped: {self._stopped()}"))

    def _stopped(self) -> str:
        code = self._broker.exitcode
        return "closed" if code in (None, 0) else f"its broker process died (exit code {code})"


def _settle(waiters: list, outcomes: list[Outcome] | BaseException) -> None:
    """Give each waiter its outcome (or every waiter the error): a Future here, and the
    asyncio futures of each event loop in one callback on that loop."""
    on_loops: dict[asyncio.AbstractEventLoop, list] = {}
    for number, waiter in enumerate(waiters):
        result = outcomes if isinstance(outcomes, BaseException) else outcomes[number]
        if isinstance(waiter, Future):
            _set(waiter, result)
        else:
            loop, future = waiter
            on_loops.setdefault(loop, []).append((future, result))
    for loop, settled in on_loops.items():
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(_set_all, settled)


def _set_all(settled: list) -> None:
    for future, result in settled:
        if not future.done():  # cancelled meanwhile
            _set(future, result)


def _set(future, result) -> None:
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _broker_main(calls, results, reward: RewardRef, options, num_workers: int, timeout_s):
    """The broker's process: it starts the reward processes, so it may have children
    although it is a daemon (which ties it to its parent). SIGTERM, sent when the parent
    exits without closing the pool, stops them too; Ctrl-C is the parent's to handle (it
    closes the pool), so the broker and its processes ignore SIGINT."""
    multiprocessing.current_process().daemon = False
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _Broker(calls, results, reward, options, num_workers, timeout_s).run()


MAX_CHUNK = 32  # calls handed to one process at once, at most


def chunk_size(queued: int, workers: int) -> int:
    """Calls for the next idle process: an eighth of a fair share of the queue, 1 to
    :data:`MAX_CHUNK`. A process takes its chunk in one round trip, so a long queue (a
    rollout's samples finishing together) does not pay one round trip a call; a hung call
    also holds up the calls behind it in its chunk (they go to another process once it is
    killed), which a short queue keeps to none."""
    return max(1, min(MAX_CHUNK, queued // (8 * workers)))


class _Broker:
    """Calls from the parent to idle reward processes (loaded ones first), one chunk at a
    time each; results back in batches; a process past its deadline or dead is replaced."""

    def __init__(self, calls, results, reward, options, num_workers: int, timeout_s: float):
        self.calls, self.results, self.timeout_s = calls, results, timeout_s
        self.reward, self.options = reward, options
        # fork: this process runs no threads, and a new process starts at once (spawn
        # where there is no fork); each imports the reward itself, after the fork
        methods = multiprocessing.get_all_start_methods()
        self.ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self.workers = [self._new_worker() for _ in range(num_workers)]
        self.queue: deque[int] = deque()
        self.pending: dict[int, tuple[str, Any]] = {}  # index -> (response, label)

    def run(self) -> None:
        try:
            while True:
                deadline = min(worker.deadline for worker in self.workers)
                timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
                ready = wait([self.calls, *(w.conn for w in self.workers)], timeout)
                if self.calls in ready and not self._receive():
                    return
                self._collect()
                self._dispatch()
        except BrokenPipeError:  # the parent is gone: nobody to answer
            return
        finally:
            for worker in self.workers:
                if not worker.broken:
                    worker.stop(kill=bool(worker.owed) or not worker.ready)

    def _new_worker(self) -> Worker:
        return Worker(self.ctx, self.reward, self.options)

    def _receive(self) -> bool:
        """Queue the calls that arrived; False once the parent says stop or is gone."""
        try:
            while self.calls.poll():
                calls = self.calls.recv()
                if calls is None:
                    return False
                for index, response, label in calls:
                    self.pending[index] = (response, label)
                    self.queue.append(index)
        except EOFError:
            return False
        return True

    def _collect(self) -> None:
        done = []
        for slot, worker in enumerate(self.workers):
            done += worker.collect()
            if worker.broken:
                self._replace(slot)
        for index, _ in done:
            del self.pending[index]
        if done:
            self.results.send(done)

    def _dispatch(self) -> None:
        """Queued calls to the idle processes (loaded ones first), in chunks while the
        queue is long (:func:`chunk_size`)."""
        slots = [i for i, w in enumerate(self.workers) if not w.owed]
        slots.sort(key=lambda i: not self.workers[i].ready)
        for slot in slots:
            if not self.queue:
                return
            size = chunk_size(len(self.queue), len(self.workers))
            chunk = [self.queue.popleft() for _ in range(size)]
            self.workers[slot].send([(i, *self.pending[i]) for i in chunk], self.timeout_s)
            if self.workers[slot].broken:  # it died while idle: the calls go back
                self._replace(slot)

    def _replace(self, slot: int) -> None:
        """A new process in ``slot``; what the old one still owed goes first to another."""
        self.queue.extendleft(reversed(self.workers[slot].owed))
        self.workers[slot] = self._new_worker()
