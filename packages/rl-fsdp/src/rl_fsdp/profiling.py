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

:func:`copy_sources` runs a step under the profiler with Python stacks and sums the device
time of its copies, memsets and NCCL kernels by the operator that launched them and the
Python lines that called it; host<->device memcpys (the ones that leave the GPU idle while
the host waits) are listed on their own.
"""

import contextlib
import cProfile
import pstats
import re
import sys
import time
import traceback
import warnings
from collections import Counter
from typing import NamedTuple

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


def step_report(step, device: torch.device) -> dict:
    """The benches' ``--profile``: :func:`profile_step`'s summary, with one more step each
    under :func:`sync_points` (``"syncs"``) and :func:`copy_sources` (``"copies"``)."""
    report = profile_step(step, device)
    report["syncs"] = sync_points(step, device)
    report["copies"] = copy_sources(step, device)
    return report


# A Python frame as the profiler names it (a Python-function event, or an entry of an
# operator's ``stack``): "rl_fsdp/forward.py(42): micro_batch". A Python-function event's
# line is the function's ``def`` line, not the line of the call: it names the function.
FRAME = re.compile(r"^(?P<path>.+?\.py)\((?P<line>\d+)\): (?P<func>.+)$")
OWN_CODE = ("megatron/", "rl_megatron/", "rl_core/", "rl_fsdp/", "rl_launcher/", "transformers/")
LIBRARIES = ("torch/", "triton/", "functorch/", "rl_fsdp/profiling.py")  # say how, not where
BACKWARD_NODE = "autograd::engine::evaluate_function: "
HOST_DEVICE = ("HtoD", "DtoH")  # in the names of host<->device memcpys


class CopyLaunch(NamedTuple):
    """One copy, memset or NCCL kernel: the operators that launched it, outermost first
    (``"ToCopyBackward0 > aten::_to_copy > aten::copy_[c10::BFloat16, float]"``), the
    Python frames they were called from, outermost first (a backward operator's are its
    forward operator's), the kernel's name and its device time in microseconds."""

    op: str
    stack: tuple[str, ...]
    kernel: str
    us: float


def copy_sources(step, device: torch.device, *, top: int = 15, frames: int = 4) -> dict:
    """Run ``step()`` once under the profiler (CPU + CUDA, Python stacks, dtypes) and
    attribute its copy/memset/NCCL device time to source lines; see :func:`copy_report`
    for the fields. On CPU there are no device copies: the step is not run and
    ``"skipped"`` says so."""
    if device.type != "cuda":
        return {"total_ms": 0.0, "top": [], "skipped": "no CUDA device: no device copies"}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    _sync(device)
    with profile(activities=activities, with_stack=True, record_shapes=True) as prof:
        step()
        _sync(device)
    events = prof.events()
    device_us = sum(
        e.time_range.elapsed_us()
        for e in events
        if e.device_type == DeviceType.CUDA and category(e.name) == "nccl+copy"
    )
    return copy_report(copy_launches(events), device_us=device_us, top=top, frames=frames)


def copy_launches(events) -> list[CopyLaunch]:
    """The copy/memset/NCCL kernels of profiler ``events`` with the CPU operator each was
    launched from (``FunctionEvent.kernels``: the device activities correlated with it)."""
    forward_ops = forward_operators(events)
    launches = []
    for event in events:
        copies = [k for k in event.kernels if _is_copy_kernel(k.name)]
        if copies:
            op, stack = launch_origin(event, forward_ops)
            launches += [CopyLaunch(op, stack, k.name, k.duration) for k in copies]
    return launches


def _is_copy_kernel(name: str) -> bool:
    # "aten::" kernels are the legacy profiler's per-operator CUDA time, not device work
    return category(name) == "nccl+copy" and not name.startswith("aten::")


def forward_operators(events) -> dict:
    """``{(thread, sequence_nr): operator}`` of the forward operators that recorded an
    autograd node: a backward node names its forward one by ``(fwd_thread, sequence_nr)``.
    Several nested operators share a number; the last one started is the node's maker."""
    return {
        (e.thread, e.sequence_nr): e
        for e in events
        if e.sequence_nr >= 0 and not e.fwd_thread and not e.name.startswith(BACKWARD_NODE)
    }


def launch_origin(event, forward_ops: dict) -> tuple[str, tuple[str, ...]]:
    """The operators from ``event`` out to its Python caller (or backward node), and the
    Python frames above them, outermost first. A backward operator without Python frames
    of its own (the autograd thread runs no Python) takes its forward operator's."""
    ops, frames, node = [_op_name(event)], [], None
    parent = event.cpu_parent
    while parent is not None and node is None:
        if parent.name.startswith(BACKWARD_NODE):
            node = parent
        elif FRAME.match(parent.name):
            frames.append(parent.name)
        elif not frames and not parent.name.startswith(("<built-in", "nn.Module: ")):
            ops.append(parent.name)
        parent = parent.cpu_parent
    if node is not None:
        ops.append(node.name.removeprefix(BACKWARD_NODE))
    stack = frames[::-1] or list(reversed(event.stack or []))  # stack: innermost first
    forward = forward_ops.get((node.fwd_thread, node.sequence_nr)) if node else None
    if forward is not None and not stack:
        stack = list(launch_origin(forward, {})[1])
    chain = list(dict.fromkeys(reversed(ops)))
    chain = chain if len(chain) <= 4 else [chain[0], "...", *chain[-3:]]
    return " > ".join(chain), tuple(stack)


def _op_name(event) -> str:
    """The operator's name with its tensors' dtypes when recorded (copies show the cast)."""
    dtypes = [d for d in getattr(event, "input_dtypes", None) or [] if d and d[0].islower()]
    return f"{event.name}[{', '.join(dtypes)}]" if dtypes else event.name


def copy_report(launches, *, device_us: float, top: int, frames: int) -> dict:
    """``total_ms``: all copy/memset/NCCL device time of the step (``profile_step``'s
    "nccl+copy"); ``copy_ms`` / ``nccl_ms``: the part attributed to an operator, copies
    and memsets apart from NCCL; ``unattributed_ms``: launched outside any operator.
    ``top`` (copies, memsets) and ``nccl``: ``[{"ms", "count", "max_ms", "kernel", "op",
    "where"}]`` by device time; ``host_device``: the HtoD/DtoH memcpys, longer stacks."""
    nccl = [launch for launch in launches if "nccl" in launch.kernel.lower()]
    copies = [launch for launch in launches if "nccl" not in launch.kernel.lower()]
    host_device = [c for c in copies if any(way in c.kernel for way in HOST_DEVICE)]
    attributed_us = sum(launch.us for launch in launches)
    return {
        "total_ms": round(device_us / 1e3, 3),
        "copy_ms": round(sum(c.us for c in copies) / 1e3, 3),
        "nccl_ms": round(sum(n.us for n in nccl) / 1e3, 3),
        "unattributed_ms": round(max(device_us - attributed_us, 0.0) / 1e3, 3),
        "top": group_launches(copies, top=top, frames=frames),
        "nccl": group_launches(nccl, top=top, frames=frames),
        "host_device": group_launches(host_device, top=top, frames=frames + 2),
    }


def group_launches(launches, *, top: int, frames: int) -> list[dict]:
    """Launches summed by (kernel kind, operators, call site), the ``top`` by device time."""
    groups: dict[tuple, list] = {}
    for launch in launches:
        key = (copy_kind(launch.kernel), launch.op, call_site(launch.stack, frames))
        entry = groups.setdefault(key, [0, 0.0, 0.0])
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + launch.us, max(entry[2], launch.us)
    ranked = sorted(groups.items(), key=lambda item: -item[1][1])[:top]
    return [
        {"ms": round(us / 1e3, 3), "count": n, "max_ms": round(longest / 1e3, 3)}
        | {"kernel": kind, "op": op, "where": where}
        for (kind, op, where), (n, us, longest) in ranked
    ]


def copy_kind(kernel: str) -> str:
    """A copy kernel's name without its template noise: ``"nccl AllGather"``, the memcpy or
    memset as named (``"Memcpy DtoH (Device -> Pageable)"``), or the copy function with
    the source dtype of its lambda (``"bfloat16_copy_kernel_cuda(float)"``)."""
    collective = re.search(r"nccl(?:DevKernel_|Kernel_)?([A-Za-z]+)", kernel, re.IGNORECASE)
    if collective:
        return f"nccl {collective.group(1)}"
    if kernel.lower().startswith(("memcpy", "memset")):
        return kernel
    needles = dict(CATEGORIES)["nccl+copy"].split()
    for needle in needles:
        found = re.search(rf"\w*{re.escape(needle)}\w*", kernel, re.IGNORECASE)
        if found:
            source = re.search(r"lambda\((\w+)\)", kernel)
            return found.group(0) + (f"({source.group(1)})" if source else "")
    return kernel[:80]


def call_site(stack, frames: int) -> str:
    """The last ``frames`` frames of ``stack`` (outermost first) outside torch, triton and
    the standard library, those of megatron, transformers and this project first, and
    always the innermost such frame; a library frame below them is added in brackets
    (``"... > rl_fsdp/backend.py:88 step [in torch/distributed/...:12 foreach_all_gather]"``)."""
    parsed = [found.groups() for found in map(FRAME.match, stack) if found]
    own = [f for f in parsed if not _library(f[0])]
    preferred = [f for f in own if any(f"/{code}" in "/" + f[0] for code in OWN_CODE)]
    picked = (preferred or own or parsed)[-frames:]
    if own and own[-1] not in picked:
        picked = [*picked, own[-1]][-frames:]
    text = " > ".join(map(_frame_text, picked))
    if parsed and parsed[-1] not in picked:
        text += f" [in {_frame_text(parsed[-1])}]"
    return text or "(no Python frames)"


def _library(path: str) -> bool:
    path = "/" + path.replace("\\", "/")
    if any(f"/{library}" in path for library in LIBRARIES):
        return True
    if "/lib/python3" in path and "-packages/" not in path:  # an absolute stdlib path
        return True
    top = path.split("/")[1].removesuffix(".py")
    return top in sys.stdlib_module_names or top.startswith("<")


def _frame_text(frame: tuple[str, str, str]) -> str:
    path, line, func = frame
    return f"{_short(path) if path.startswith('/') else path}:{line} {func}"
