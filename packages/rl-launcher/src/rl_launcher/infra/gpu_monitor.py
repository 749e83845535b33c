"""GPU utilisation sampled while a CUDA run goes: ``gpu/util/<i>`` (mean % of the step's
samples) and ``gpu/mem_gb/<i>`` (largest memory in use) per step, for each GPU ``i`` the
run may use (``CUDA_VISIBLE_DEVICES`` when set, else all).

One ``nvidia-smi --loop-ms`` process prints a CSV line per GPU per interval; a reader
thread keeps the samples, and :meth:`GpuMonitor.take` summarises those since the last call.
No monitor (and no metric) when the run is on CPU or ``nvidia-smi`` is missing.
"""

import os
import shutil
import subprocess
import threading
from collections import defaultdict

QUERY = "--query-gpu=index,utilization.gpu,memory.used"


def smi_command(interval_ms: int, gpu_ids: str | None) -> list[str]:
    command = ["nvidia-smi", QUERY, "--format=csv,noheader,nounits", f"--loop-ms={interval_ms}"]
    return command + ([f"--id={gpu_ids}"] if gpu_ids else [])


def parse_line(line: str) -> tuple[int, float, float] | None:
    """``"0, 87, 40321"`` -> ``(0, 87.0, 40321.0)`` (index, util %, memory MiB); None when
    the line is not a sample (a header, ``[N/A]``, an error message)."""
    parts = [p.strip() for p in line.split(",")]
    try:
        index, util, mem = int(parts[0]), float(parts[1]), float(parts[2])
    except (ValueError, IndexError):
        return None
    return index, util, mem


class GpuMonitor:
    """Samples from ``command`` (an ``nvidia-smi`` loop, or anything printing its CSV)."""

    def __init__(self, command: list[str]):
        self._lock = threading.Lock()
        self._samples: list[tuple[int, float, float]] = []
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name="gpu-monitor", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if (sample := parse_line(line)) is not None:
                with self._lock:
                    self._samples.append(sample)

    def take(self) -> dict[str, float]:
        """Per-GPU mean utilisation and peak memory of the samples since the last call."""
        with self._lock:
            samples, self._samples = self._samples, []
        utils, mems = defaultdict(list), defaultdict(list)
        for index, util, mem in samples:
            utils[index].append(util)
            mems[index].append(mem)
        out = {f"gpu/util/{i}": sum(u) / len(u) for i, u in utils.items()}
        return out | {f"gpu/mem_gb/{i}": max(m) / 1024 for i, m in mems.items()}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)


def start_gpu_monitor(device: str, *, interval_ms: int = 500) -> GpuMonitor | None:
    """A monitor for a CUDA run with ``nvidia-smi`` on PATH, else None."""
    if device != "cuda" or shutil.which("nvidia-smi") is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") or None
    return GpuMonitor(smi_command(interval_ms, visible))
