"""Python's garbage-collection pauses in a long-lived process, measured and made short.

A full collection (the oldest generation) walks every object the collector tracks. After
start-up the driver tracks ~0.4M of them (torch, transformers, Ray, sglang-router's
client, the tokenizer), and every step adds the rollout's samples, which survive long
enough to reach the oldest generation; so every few steps Python walks them all (about
0.2 s on a 2-core CPU machine), and everything in the process waits, the rollout's event
loop included. :func:`freeze_startup` moves what start-up built into the permanent
generation (``gc.freeze``), which collections never walk again: a full collection then
walks only what the steps left. :class:`GcPauses` times every collection for the step
metrics ``time/gc`` (seconds paused), ``time/gc_max`` (the longest pause) and
``gc/collections_full``.
"""

import gc
import time


def freeze_startup() -> int:
    """Collect once, then exclude every object alive now from later collections; returns
    how many objects were frozen. Call it once start-up is done (the objects it created
    stay alive for the whole run anyway)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze() -> None:
    """Undo :func:`freeze_startup` at the end of a run, so that shutdown frees the frozen
    objects as usual (native extensions such as Triton's report the ones left as leaks)."""
    gc.unfreeze()


class GcPauses:
    """Times the collections of this process (``gc.callbacks``) until :meth:`close`."""

    def __init__(self):
        self._started: float | None = None
        self._seconds = self._longest = 0.0
        self._full = 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        pause = time.perf_counter() - self._started
        self._started = None
        self._seconds += pause
        self._longest = max(self._longest, pause)
        self._full += info.get("generation") == 2

    def take(self) -> dict[str, float]:
        """The pauses since the last call."""
        out = {
            "time/gc": self._seconds,
            "time/gc_max": self._longest,
            "gc/collections_full": float(self._full),
        }
        self._seconds = self._longest = 0.0
        self._full = 0
        return out

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
