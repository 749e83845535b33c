"""Where the scheduler thread's time goes, from a batch's first admission until it drains:
one log line per drained batch (a rollout, a benchmark run), so a slow rollout can be
explained from the engine's log without a profiler."""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class BatchTimes:
    """Seconds of the scheduler thread per activity since the first admission:
    ``prefill`` (prefill and first-token sampling, host waits included), ``launch``
    (queueing decode rounds and their sampling), ``wait`` (the host waiting for a round's
    tokens: device time not hidden behind the host's work), ``bookkeeping`` (appending
    tokens, stop checks, finishing and compacting rows); the rest of ``wall`` is the
    thread idle or running control tasks. ``cpu``: the CPU seconds the scheduler thread
    itself used, and the whole process's (its event loop, the device runtime's threads):
    where the thread's busy time exceeds its own CPU, it waited for the GIL (held by the
    event loop) or for a core."""

    requests: int = 0
    prefills: int = 0
    rounds: int = 0
    prefill: float = 0.0
    launch: float = 0.0
    wait: float = 0.0
    bookkeeping: float = 0.0
    started: float | None = field(default=None, repr=False)
    cpu_started: tuple[float, float] = field(default=(0.0, 0.0), repr=False)

    def admitted(self, count: int) -> None:
        if self.started is None:  # on the scheduler thread, as summary() is
            self.started = time.perf_counter()
            self.cpu_started = (time.thread_time(), time.process_time())
        self.requests += count
        self.prefills += 1

    @contextmanager
    def timed(self, activity: str):
        """Add the block's seconds to ``activity`` (prefill, launch, wait, bookkeeping)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, activity, getattr(self, activity) + time.perf_counter() - start)

    def summary(self) -> str:
        wall = time.perf_counter() - (self.started or time.perf_counter())
        busy = self.prefill + self.launch + self.wait + self.bookkeeping
        thread_cpu = time.thread_time() - self.cpu_started[0]
        process_cpu = time.process_time() - self.cpu_started[1]
        return (
            f"batch drained: {self.requests} requests in {wall:.3f} s; {self.prefills} "
            f"prefills {self.prefill:.3f} s, {self.rounds} decode rounds: launch "
            f"{self.launch:.3f} s, waiting for the device {self.wait:.3f} s, bookkeeping "
            f"{self.bookkeeping:.3f} s; other {max(wall - busy, 0.0):.3f} s; CPU: the "
            f"thread {thread_cpu:.3f} s, the process {process_cpu:.3f} s"
        )
