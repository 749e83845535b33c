"""Where one training step's time goes: a single call under ``torch.profiler``, summed
into how busy the device was, the top kernels and a few categories.

    report = profile_step(lambda: backend.train_step(batch), device)
    report["busy_fraction"], report["top_kernels"][:5], report["categories_ms"]

On CUDA the "kernels" are the device activities (kernels, memcpy, memset); on CPU, where
there are none, the ``aten::`` operators, by self time (their own work, not their
children's). ``busy_fraction`` = union of the kernels' intervals / the step's wall time
(host launch gaps and syncs are what is missing from 1); ``idle_gaps`` lists the
longest stretches without a kernel and the kernels around them.

:func:`sync_points` runs a step under CUDA's sync debug mode and counts where the host
waited for the device (``.item()``, ``.cpu()``, ``.tolist()``, ...), by source line.

:func:`host_profile` runs a step under ``cProfile``: where the host's own time goes
(Python functions and the C calls they make: FSDP hooks, compiled-graph wrappers, kernel
launches), which decides the step's speed when the device waits for the host.
"""

import contextlib
import cProfile
import pstats
import time
import traceback
import warnings
from collections import Counter

import torch

# Needles (space-separated) in kernel names; first match wins: attention before gemm
# (flash kernels name cutlass types), copies before elementwise (FSDP's all-gather copy-in
# and casts). "optimizer" includes the grad-norm of clipping (multi-tensor kernels too).
CATEGORIES = (
    ("attention", "flash fmha attention sdpa flex"),
    (
        "nccl+copy",
        "nccl memcpy memset chunk_cat split_with_sizes direct_copy copy_kernel aten::copy_",
    ),
    (
        "gemm",
        "gemm nvjet cutlass cublas xmma wgmma aten::mm aten::addmm aten::bmm aten::baddbmm matmul",
    ),
    ("optimizer", "adam multi_tensor foreach"),
    (
        "elementwise+norm",
        "elementwise triton reduce norm vectorized softmax index scatter gather cat fill aten::",
    ),
)


def category(name: str) -> str:
    """The category of a kernel or operator name (see :data:`CATEGORIES`), else "other"."""
    lowered = name.lower()
    for label, needles in CATEGORIES:
        if any(needle in lowered for needle in needles.split()):
            return label
    return "other"


def profile_step(step, device: torch.device, *, top: int = 25) -> dict:
    """Run ``step()`` once under the profiler; see the module docstring for the fields.
    On CUDA only device activity is recorded (no per-operator host overhead added to
    the step); the wall time is the host clock around ``step()`` and a device sync."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        _sync(device)
        wall_us = (time.perf_counter() - start) * 1e6
    if cuda:
        kernels = [
            (e.name, e.time_range.start, e.time_range.end, e.time_range.elapsed_us())
            for e in prof.events()
            if e.device_type == DeviceType.CUDA
        ]
    else:
        kernels = [
            (e.name, e.time_range.start, e.time_range.end, e.self_cpu_time_total)
            for e in prof.events()
            if e.name.startswith("aten::")
        ]
    return summarize(kernels, wall_us, top=top, device=device.type)


def summarize(kernels, wall_us: float, *, top: int, device: str) -> dict:
    """``kernels``: ``(name, start_us, end_us, own_us)`` of one step of ``wall_us``."""
    wall = max(wall_us, 1e-9)
    busy = min(_union((a, b) for _, a, b, _ in kernels), wall)
    totals: dict[str, list] = {}
    for name, _, _, own in kernels:
        entry = totals.setdefault(name, [0, 0.0])
        entry[0], entry[1] = entry[0] + 1, entry[1] + own
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])
    categories = dict.fromkeys([label for label, _ in CATEGORIES] + ["other"], 0.0)
    for name, (_, own) in totals.items():
        categories[category(name)] += own / 1e3
    return {
        "device": device,
        "kernels_are": "device kernels" if device == "cuda" else "aten ops (self CPU time)",
        "step_ms": wall / 1e3,
        "busy_ms": busy / 1e3,
        "busy_fraction": busy / wall,
        "kernel_count": len(kernels),
        "kernel_ms": sum(own for *_, own in kernels) / 1e3,
        "categories_ms": {label: round(ms, 3) for label, ms in categories.items()},
        "top_kernels": [_entry(name, count, own) for name, (count, own) in ranked[:top]],
        "idle_gaps": idle_gaps(kernels),
    }


def idle_gaps(kernels, *, min_us: float = 50.0, top: int = 5) -> dict:
    """Stretches of at least ``min_us`` with no kernel running (host syncs, launch-bound
    code): how many, their total, and the largest with the kernels on either side."""
    gaps, reach, last = [], None, ""
    for start, end, name in sorted((a, b, n) for n, a, b, _ in kernels if b > a):
        if reach is not None and start - reach >= min_us:
            gaps.append((start - reach, last, name))
        if reach is None or end > reach:
            reach, last = end, name
    gaps.sort(key=lambda gap: -gap[0])
    largest = [
        {"ms": round(us / 1e3, 3), "after": a[:80], "before": b[:80]} for us, a, b in gaps[:top]
    ]
    return {"count": len(gaps), "total_ms": sum(g[0] for g in gaps) / 1e3, "largest": largest}


def _entry(name: str, count: int, own_us: float) -> dict:
    total_ms = round(own_us / 1e3, 3)
    return {"name": name[:120], "count": count, "total_ms": total_ms, "category": category(name)}


def _union(intervals) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    covered, reach = 0.0, float("-inf")
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if b > reach:
            covered += b - max(a, reach)
            reach = b
    return covered


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


SYNC_WARNING = "synchronizing"  # in the text of torch's sync-debug warning


def sync_points(step, device: torch.device, *, frames: int = 3, top: int = 20) -> dict:
    """Run ``step()`` once with ``torch.cuda.set_sync_debug_mode("warn")``; every host
    sync is counted under the last ``frames`` frames of its Python stack (innermost
    last). ``{"total": n, "top": [{"count", "where"}, ...]}``; on CPU nothing syncs and
    the step is not run (``"skipped"`` says so)."""
    if device.type != "cuda":
        return {"total": 0, "top": [], "skipped": "no CUDA device: nothing to wait for"}
    previous = torch.cuda.get_sync_debug_mode()
    with count_sync_warnings(frames) as counts:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sync_report(counts, top=top)


@contextlib.contextmanager
def count_sync_warnings(frames: int = 3):
    """Within the block, each warning naming a synchronizing CUDA operation is counted in
    the yielded Counter (by stack summary, :func:`where`) instead of shown; others pass on."""
    counts: Counter = Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def count(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING in str(message):
                counts[where(traceback.extract_stack()[:-1], frames)] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = count
        yield counts


def where(stack: traceback.StackSummary, frames: int) -> str:
    """The last ``frames`` frames outside the warnings machinery, ``file:line func`` each,
    joined with `` > `` (outermost first)."""
    kept = [f for f in stack if f.filename != __file__ and not f.filename.endswith("warnings.py")]
    parts = [f"{_short(f.filename)}:{f.lineno} {f.name}" for f in kept[-frames:]]
    return " > ".join(parts)


def sync_report(counts: Counter, *, top: int) -> dict:
    ranked = counts.most_common(top)
    return {
        "total": sum(counts.values()),
        "top": [{"count": n, "where": place} for place, n in ranked],
    }


def _short(filename: str) -> str:
    """A path from its package or site-packages folder on (``rl_fsdp/forward.py``)."""
    parts = filename.replace("\\", "/").split("/")
    for anchor in ("site-packages", "src", "bench"):
        if anchor in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(anchor) :])
    return "/".join(parts[-2:])


def host_profile(step, device: torch.device, *, top: int = 30) -> dict:
    """Run ``step()`` once under ``cProfile``. ``{"step_ms", "profiled_ms", "functions":
    [{"where", "calls", "own_ms", "total_ms"}, ...]}``: the ``top`` functions by their own
    time (``own_ms``; ``total_ms`` includes what they call), ``where`` as ``file:line name``.
    ``step_ms`` is the wall time of the profiled step (cProfile slows Python down, so
    read the shares, not the absolute figures)."""
    _sync(device)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    try:
        step()
        _sync(device)
    finally:
        profiler.disable()
    wall_ms = (time.perf_counter() - start) * 1e3
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, calls, own, total, _)}
    ranked = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    functions = [
        {
            "where": f"{_short(file)}:{line} {name}"[:160],
            "calls": calls,
            "own_ms": round(own * 1e3, 3),
            "total_ms": round(total * 1e3, 3),
        }
        for (file, line, name), (_, calls, own, total, _) in ranked
    ]
    profiled = sum(own for _, _, own, _, _ in stats.values()) * 1e3
    return {"step_ms": wall_ms, "profiled_ms": profiled, "functions": functions}
