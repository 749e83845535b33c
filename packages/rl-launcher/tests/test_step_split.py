"""The per-step overhead and in-loop throughput (loop.split_step) and the GPU sampler
(infra.gpu_monitor) fed by a process printing nvidia-smi's CSV loop format."""

import sys
import time

import pytest

from rl_launcher.infra.gpu_monitor import GpuMonitor, parse_line, smi_command, start_gpu_monitor
from rl_launcher.loops.step_metrics import split_step


def test_overhead_is_the_step_outside_rollout_and_trainer_compute():
    times = {
        "time/rollout": 1.5,
        "time/log_probs": 0.7,
        "time/train": 3.0,
        "time/rollout_wait": 0.5,
        "time/sync": 0.3,
        "time/step": 6.0,
    }
    worker = {"time/log_probs_compute": 0.5, "time/train_compute": 2.5}
    out = split_step(times, worker, tokens=10_000)
    assert out["time/overhead"] == pytest.approx(6.0 - 2.0 - 0.5 - 2.5)
    assert out["time/overhead_frac"] == pytest.approx(1.0 / 6.0)
    assert out["perf/train_tokens_per_s"] == pytest.approx(4000.0)
    assert out["perf/train_tokens_per_s_wall"] == pytest.approx(10_000 / 3.0)
    assert {k: out[k] for k in times} == times


def test_colocated_hand_over_before_a_rollout_is_overhead_and_sync_is_split_out():
    times = {
        "time/rollout": 2.0,
        "time/log_probs": 1.0,
        "time/train": 2.0,
        "time/sync": 0.5,
        "time/step": 5.5,
    }
    worker = {
        "time/log_probs_compute": 0.5,
        "time/train_compute": 1.5,
        "time/turns/in_rollout": 0.4,
    }
    out = split_step(times, worker, tokens=100)
    assert out["time/overhead"] == pytest.approx(5.5 - 1.6 - 2.0)
    assert out["time/overhead_excl_sync"] == pytest.approx(5.5 - 1.6 - 2.0 - 0.5)
    assert out["time/overhead_excl_sync_frac"] == pytest.approx(1.4 / 5.5)


def test_no_worker_times_means_no_throughput_and_overhead_never_negative():
    out = split_step({"time/rollout": 1.2, "time/step": 1.0}, {}, tokens=5)
    assert out["time/overhead"] == 0.0
    assert "perf/train_tokens_per_s" not in out


def test_parse_line_takes_samples_and_skips_anything_else():
    assert parse_line("0, 87, 40321\n") == (0, 87.0, 40321.0)
    assert parse_line("index, utilization.gpu [%], memory.used [MiB]") is None
    assert parse_line("1, [N/A], 10") is None
    assert parse_line("NVIDIA-SMI has failed") is None


def test_smi_command_limits_to_the_visible_gpus():
    assert smi_command(250, "2,3")[-2:] == ["--loop-ms=250", "--id=2,3"]
    assert smi_command(500, None)[-1] == "--loop-ms=500"


def test_monitor_summarises_the_samples_of_each_interval():
    printer = (
        "import sys, time\n"
        "for util in (10, 30):\n"
        "    print(f'0, {util}, 2048'); print(f'1, {util + 60}, 1024'); sys.stdout.flush()\n"
        "time.sleep(60)\n"
    )
    monitor = GpuMonitor([sys.executable, "-c", printer])
    try:
        deadline = time.monotonic() + 20
        while len(monitor._samples) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        first = monitor.take()
        assert first == {
            "gpu/util/0": 20.0,
            "gpu/util/1": 80.0,
            "gpu/mem_gb/0": 2.0,
            "gpu/mem_gb/1": 1.0,
        }
        assert monitor.take() == {}  # nothing new since
    finally:
        monitor.close()
    assert monitor.proc.poll() is not None


def test_no_monitor_on_cpu():
    assert start_gpu_monitor("cpu") is None
