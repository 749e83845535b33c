"""The run directory's ``metrics.jsonl`` (one JSON object per step) and the progress line.

Each record is written with a single ``os.write`` on a file opened with ``O_APPEND``, so a
record is never interleaved with another writer's and a crash leaves at most one partial
last line, which :func:`read_metrics` skips. Non-finite numbers are stored as null.

Metric names the progress line and ``rl-plot`` read (all optional):
``rollout/reward/mean``, ``rollout/response_length/mean``, ``train/kl``, ``train/entropy``,
``eval/<dataset>/pass@<k>``, ``time/step``, ``time/rollout``, ``time/log_probs``,
``time/train``, ``time/sync``, ``train/num_samples`` and ``rollout/num_samples`` (samples
trained / produced by the step's rollout), ``buffer/empty_cause`` (a string: why a step
trained nothing).
"""

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
TIME_PARTS = ("rollout", "log_probs", "train", "sync", "eval")


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):  # numpy / torch scalars
        return _clean(value.item())
    return value


class MetricsLog:
    """Appends one record per step to ``<run_dir>/metrics.jsonl``, and to TensorBoard and
    wandb when ``logging`` (a :class:`~rl_launcher.config.LoggingConfig`) enables them."""

    def __init__(self, run_dir: str | Path, *, logging=None):
        from rl_launcher.infra.log_sinks import open_sinks

        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.sinks = open_sinks(logging, Path(run_dir)) if logging is not None else []

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def append(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Write ``{"step": step, "time": now, **metrics}`` as one line; returns the record."""
        record = {"step": step, "time": time.time(), **{k: _clean(v) for k, v in metrics.items()}}
        line = (json.dumps(record, allow_nan=False) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, line)
        finally:
            os.close(fd)
        assert written == len(line), "short write to metrics.jsonl"
        numbers = {k: v for k, v in record.items() if isinstance(v, int | float) and k != "time"}
        for sink in self.sinks:
            sink.log(step, numbers)
        return record


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl (or of the one in a run directory), skipping a torn last line."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"no metrics file at {str(path)!r}; is this a run directory?")
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number != len(lines):
                raise ValueError(f"{path}:{number}: not a JSON record") from None
    return records


def truncate_metrics(run_dir: str | Path, last_step: int) -> int:
    """Drop records after ``last_step`` (steps a resumed run will redo); atomic rewrite.
    Returns how many records were dropped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    records = read_metrics(path)
    kept = [r for r in records if r.get("step", 0) <= last_step]
    tmp = path.with_name(METRICS_FILE + ".tmp")
    tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
    os.replace(tmp, path)
    return len(records) - len(kept)


def format_progress(step: int, num_steps: int, metrics: dict[str, Any]) -> str:
    """``step 3/20 | reward 0.412 | len 17.3 | kl 0.0012 | trained 48/64 | 1.23s (rollout
    0.80 ...)``; a step that trained nothing says why: ``trained 0/64 (nothing learnt: of 64
    samples, ...)``."""
    parts = [f"step {step}/{num_steps}"]
    for label, key, spec in (
        ("reward", "rollout/reward/mean", ".3f"),
        ("sft loss", "loss/sft", ".4f"),
        ("len", "rollout/response_length/mean", ".1f"),
        ("kl", "train/kl", ".4g"),
        ("entropy", "train/entropy", ".3f"),
    ):
        if metrics.get(key) is not None:
            parts.append(f"{label} {metrics[key]:{spec}}")
    if (trained := trained_part(metrics)) is not None:
        parts.append(trained)
    if metrics.get("time/step") is not None:
        split = " ".join(
            f"{name} {metrics[f'time/{name}']:.2f}"
            for name in TIME_PARTS
            if metrics.get(f"time/{name}") is not None
        )
        parts.append(f"{metrics['time/step']:.2f}s" + (f" ({split})" if split else ""))
    return " | ".join(parts)


def trained_part(metrics: dict[str, Any]) -> str | None:
    """``trained 48/64`` (samples trained / produced by the step's rollout), with the
    cause when it is 0 (``buffer/empty_cause``); None for steps that do not count them."""
    trained, produced = metrics.get("train/num_samples"), metrics.get("rollout/num_samples")
    if trained is None or produced is None:
        return None
    text = f"trained {trained:.0f}/{produced:.0f}"
    if not trained:
        text += f" (nothing learnt: {metrics.get('buffer/empty_cause', 'cause unknown')})"
    return text


@contextlib.contextmanager
def startup_phase(what: str, *, show: bool = True) -> Iterator[None]:
    """One console line when a start-up phase ends: ``rl-train: trainer ready in 8.1s``,
    so the 20-30 s before the first step are never silent (``show``: logging.progress)."""
    start = time.perf_counter()
    yield
    if show:
        print(f"rl-train: {what} in {time.perf_counter() - start:.1f}s", flush=True)
