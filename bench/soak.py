"""Soak: the quickstart run for ``--minutes`` in a chosen loop mode, with the resident memory
(RSS) of every process of the run sampled; prints and writes one JSON object.

    python bench/soak.py --minutes 20 --loop async --out soak.json

Processes are the ``rl-train`` driver and everything it starts (Ray's workers and
daemons, engines, the router), found by walking ``/proc`` from the driver's process group
and from Ray's session processes. Each process is named by its command line (trimmed).
Sampling starts after ``--warmup-steps`` training steps (imports, allocator pools and
compiled code settle first). Growth of a process = median RSS over the last quarter of its
samples minus the median over its second quarter.
The run fails the bound when any process grows more than ``--bound-mb`` MiB.
Run it from the repository root (it uses ``uv run --package rl-launcher rl-train``).
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import write_report

PAGE = os.sysconf("SC_PAGE_SIZE")


def read_proc(pid: int) -> tuple[int, int, str] | None:
    """``(ppid, rss_bytes, command line)`` of ``pid``, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        rss_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
        cmd = (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError, ValueError):
        return None
    ppid = int(stat.rsplit(")", 1)[1].split()[1])
    return ppid, rss_pages * PAGE, cmd.strip()


def descendants(root: int) -> dict[int, tuple[int, str]]:
    """Every live process under ``root`` (itself included): pid -> (rss, command)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := read_proc(int(entry))) is not None:
            table[int(entry)] = info
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = {}, [root]
    while stack:
        pid = stack.pop()
        if pid in table:
            found[pid] = (table[pid][1], table[pid][2])
            stack.extend(children.get(pid, []))
    return found


def label(pid: int, command: str) -> str:
    return f"{pid} {command[:90]}"


def growth_mb(samples: list[int]) -> float | None:
    """Median of the last quarter minus median of the second quarter, in MiB."""
    quarter = len(samples) // 4
    if quarter < 2:
        return None
    second, last = samples[quarter : 2 * quarter], samples[-quarter:]
    return (statistics.median(last) - statistics.median(second)) / 2**20


def soak(args) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="soak-")) / "run"
    command = [
        "uv",
        "run",
        "--package",
        "rl-launcher",
        "rl-train",
        "--config",
        args.config,
        "--num_steps",
        "1000000",
        "--rollout.loop",
        args.loop,
        "--checkpoint.interval",
        "0",
        "--logging.run_dir",
        str(run_dir),
    ]
    with open(run_dir.parent / "stderr.log", "w") as stderr:
        driver = subprocess.Popen(
            command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=stderr
        )
        series, exit_code = _sample(driver, args, run_dir)
    steps = _count_steps(run_dir)
    report = _summarise(series, args.bound_mb)
    report |= {
        "loop": args.loop,
        "minutes": args.minutes,
        "steps": steps,
        "crashed": exit_code is not None,
        "run_dir": str(run_dir),
    }
    return report


def _sample(driver: subprocess.Popen, args, run_dir: Path):
    """RSS of every process of the run every ``args.interval`` s, from the moment
    ``args.warmup_steps`` steps are done until the time is up (warm-up excluded)."""
    series: dict[str, list[int]] = {}
    names: dict[int, str] = {}  # a process keeps its first name (Ray workers rename themselves)
    deadline = time.monotonic() + args.minutes * 60
    try:
        while time.monotonic() < deadline and driver.poll() is None:
            if _count_steps(run_dir) >= args.warmup_steps:
                for pid, (rss, cmd) in descendants(driver.pid).items():
                    series.setdefault(names.setdefault(pid, label(pid, cmd)), []).append(rss)
            time.sleep(args.interval)
    finally:
        exit_code = driver.poll()
        if exit_code is None:
            os.killpg(driver.pid, signal.SIGTERM)  # rl-train unwinds: engines, router, Ray
            driver.wait(120)
    return series, exit_code


def _count_steps(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return sum(1 for _ in metrics.open()) if metrics.exists() else 0


def _summarise(series: dict[str, list[int]], bound_mb: float) -> dict:
    processes = {}
    for name, samples in series.items():
        grown = growth_mb(samples)
        processes[name] = {
            "samples": len(samples),
            "rss_first_mb": samples[0] / 2**20,
            "rss_peak_mb": max(samples) / 2**20,
            "rss_last_mb": samples[-1] / 2**20,
            "growth_mb": grown,
        }
    judged = [p["growth_mb"] for p in processes.values() if p["growth_mb"] is not None]
    worst = max(judged, default=0.0)
    return {
        "bound_mb": bound_mb,
        "worst_growth_mb": worst,
        "within_bound": worst <= bound_mb,
        "processes": processes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/quickstart/config.yaml")
    parser.add_argument("--loop", default="async", choices=("sync", "one_step_async", "async"))
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--warmup-steps", type=int, default=10, help="steps before sampling")
    parser.add_argument("--bound-mb", type=float, default=50.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = soak(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        write_report(report, args.out)
    sys.exit(0 if report["within_bound"] and not report["crashed"] else 1)


if __name__ == "__main__":
    main()
