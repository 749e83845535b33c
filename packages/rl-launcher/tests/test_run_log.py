"""metrics.jsonl appends, the progress line, and rl-plot's PNG charts."""

import json
import math
import multiprocessing
import struct

import pytest

from rl_launcher.cli import plot_main
from rl_launcher.infra.run_log import MetricsLog, format_progress, read_metrics, truncate_metrics
from rl_launcher.plots import plot_run, time_split, time_split_series

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def step_metrics(step):
    return {
        "rollout/reward/mean": step / 10,
        "rollout/response_length/mean": 20.0 - step,
        "train/kl": 0.001 * step,
        "train/entropy": 2.0 - 0.1 * step,
        "time/step": 1.5,
        "time/rollout": 1.0,
        "time/log_probs": 0.1,
        "time/train": 0.3,
        "time/sync": 0.05,
        **(
            {"eval/arith/pass@1": 0.1 * step, "eval/arith/pass@4": 0.2 * step}
            if step % 2 == 0
            else {}
        ),
    }


def test_one_record_per_step_with_nonfinite_as_null(tmp_path):
    log = MetricsLog(tmp_path / "run")
    log.append(1, {"loss": 0.5, "bad": math.nan})
    log.append(2, {"loss": 0.25, "inf": math.inf})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    records = read_metrics(tmp_path / "run")
    assert records[0]["bad"] is None and records[1]["inf"] is None and records[1]["loss"] == 0.25


def test_torn_last_line_is_skipped_but_a_torn_middle_line_is_an_error(tmp_path):
    log = MetricsLog(tmp_path)
    log.append(1, {"x": 1.0})
    with log.path.open("a") as handle:
        handle.write('{"step": 2, "x"')  # a crash mid-write
    assert [r["step"] for r in read_metrics(log.path)] == [1]
    log.path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        read_metrics(log.path)
    with pytest.raises(ValueError, match="no metrics file"):
        read_metrics(tmp_path / "elsewhere")


def _append_many(path, writer):
    log = MetricsLog(path)
    for i in range(200):
        log.append(i, {"writer": writer, "padding": "x" * 300})


def test_concurrent_appenders_never_interleave(tmp_path):
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_append_many, args=(tmp_path, w)) for w in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    records = read_metrics(tmp_path)
    assert len(records) == 600
    for writer in range(3):
        assert [r["step"] for r in records if r["writer"] == writer] == list(range(200))


def test_progress_line():
    line = format_progress(3, 20, step_metrics(3))
    assert line == (
        "step 3/20 | reward 0.300 | len 17.0 | kl 0.003 | entropy 1.700 | "
        "1.50s (rollout 1.00 log_probs 0.10 train 0.30 sync 0.05)"
    )
    assert format_progress(1, 2, {"train/kl": None}) == "step 1/2"


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_rl_plot_writes_valid_pngs(tmp_path, capsys):
    log = MetricsLog(tmp_path)
    for step in range(1, 11):
        log.append(step, step_metrics(step))
    assert plot_main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    names = {"reward", "kl", "entropy", "response_length", "eval_pass_at_k", "time_split"}
    assert {p.rsplit("/", 1)[1] for p in printed} == {f"{n}.png" for n in names}
    for name in names:
        width, height = png_size(tmp_path / "plots" / f"{name}.png")
        assert (width, height) == (640, 400)


def test_rl_plot_only_draws_what_exists_and_refuses_empty_runs(tmp_path, capsys):
    log = MetricsLog(tmp_path)
    log.append(1, {"rollout/reward/mean": 0.1})
    assert [p.name for p in plot_run(tmp_path)] == ["reward.png"]
    log.path.write_text('{"step": 1, "other": 1}\n')
    with pytest.raises(ValueError, match="none of the charted metrics"):
        plot_run(tmp_path)
    assert plot_main([str(tmp_path / "missing")]) == 2
    assert "no metrics file" in capsys.readouterr().err


def test_time_split_sums_to_the_step():
    colocated = {
        "time/step": 3.0,
        "time/rollout": 1.6,
        "time/turns/in_rollout": 0.1,
        "time/log_probs": 0.5,
        "time/log_probs_compute": 0.2,
        "time/train": 0.6,
        "time/train_compute": 0.5,
        "time/sync": 0.2,
    }
    split = time_split(colocated)
    expected = {"rollout": 1.5, "log-probs": 0.2, "train": 0.5, "sync": 0.2, "eval": 0.0}
    assert split == pytest.approx(expected | {"other": 0.6})
    assert sum(split.values()) == pytest.approx(3.0)
    overlapped = {
        "time/step": 2.0,
        "time/rollout": 0.01,
        "time/rollout_wait": 0.8,
        "time/log_probs": 0.3,
        "time/train": 0.8,
        "time/sync": 0.09,
    }
    split = time_split(overlapped)  # no worker compute recorded: the phases' wall time
    assert split["rollout"] == pytest.approx(0.81) and split["log-probs"] == 0.3
    assert split["other"] == pytest.approx(0.0) and time_split({"step": 1}) is None
    records = [{"step": 1, **colocated}, {"step": 2, "rollout/reward/mean": 0.5}]
    data = time_split_series(records)
    assert list(data) == ["rollout", "log-probs", "train", "sync", "other"]  # no eval
    assert data["rollout"] == ([1], [pytest.approx(1.5)])


def test_truncate_drops_the_steps_a_resumed_run_redoes(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(1, 6):
        log.append(step, {"rollout/reward/mean": step / 10})
    assert truncate_metrics(tmp_path, 3) == 2
    records = read_metrics(tmp_path)
    assert [(r["step"], r["rollout/reward/mean"]) for r in records] == [
        (1, 0.1),
        (2, 0.2),
        (3, 0.3),
    ]
    assert truncate_metrics(tmp_path, 3) == 0 and truncate_metrics(tmp_path / "none", 1) == 0
