"""TensorBoard and wandb (offline, no network) receive what metrics.jsonl receives."""

import sys
import time

import pytest

from rl_launcher.config import LoggingConfig
from rl_launcher.infra.log_sinks import require
from rl_launcher.infra.run_log import MetricsLog, read_metrics


def test_tensorboard_events_hold_every_numeric_metric(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path, logging=LoggingConfig(run_dir=str(tmp_path), tensorboard=True))
    log.append(1, {"rollout/reward/mean": 0.25, "note": "text is not a scalar"})
    log.append(2, {"rollout/reward/mean": 0.75, "train/kl": float("nan")})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rewards = [(e.step, e.value) for e in events.Scalars("rollout/reward/mean")]
    assert rewards == [(1, 0.25), (2, 0.75)]
    assert "note" not in events.Tags()["scalars"] and "time" not in events.Tags()["scalars"]
    assert "train/kl" not in events.Tags()["scalars"]  # NaN is stored as null, not charted
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_wandb_offline_writes_a_local_run_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "")
    logging = LoggingConfig(run_dir=str(tmp_path), wandb=True, wandb_project="test")
    log = MetricsLog(tmp_path, logging=logging)
    log.append(1, {"rollout/reward/mean": 0.5})
    log.append(2, {"rollout/reward/mean": 0.625})
    log.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (events,) = runs[0].glob("run-*.wandb")  # the offline log `wandb sync` uploads later
    deadline = time.monotonic() + 30  # wandb's service process may still be flushing it
    while b"0.625" not in (data := events.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"rollout/reward/mean" in data and b"0.625" in data


def test_a_missing_extra_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"rl-launcher\[tensorboard\]"):
        require("tensorboard", "tensorboard")
