"""``rl-eval`` as a user runs it (a subprocess: an embedded engine behind the router, no
Ray): what ``--help`` says, where the summary goes (the evaluated run's directory, never
the config's ``logging.run_dir``), and rewards under the same time limit as in training
(a reward that spins for ever on one eval prompt is killed and counted)."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl_launcher.config.loader import load_config
from rl_launcher.session.model import prepare_model

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]
TESTS = Path(__file__).resolve().parent
QUICKSTART = ROOT / "examples/quickstart/config.yaml"
EVAL_BOUND_S = 240  # engine and router start (~20 s idle) and 8 samples, on a loaded machine


def rl_eval(*args, timeout=EVAL_BOUND_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "rl_launcher.eval_cli", *map(str, args)]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def test_help_says_what_model_takes_and_where_output_goes():
    shown = rl_eval("--help", timeout=60)
    assert shown.returncode == 0 and shown.stderr == ""
    text = " ".join(shown.stdout.split())
    for words in (
        "--model PATH what to evaluate: a run directory",
        "checkpoint directory",
        "Hugging Face model directory",
        "default: eval_summary.json in the run directory PATH belongs to",
        "Nothing is written into the config's logging.run_dir",
        "docs/config.md",
    ):
        assert words in text, words


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    """A run directory (metrics.jsonl) holding its starting model, built from the config."""
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    config, _ = load_config(
        [
            "--config",
            str(QUICKSTART),
            "--model.tokenizer_path",
            str(ROOT / "examples/quickstart/tokenizer"),
        ]
    )
    model_dir, _ = prepare_model(config.model, run_dir=run_dir, seed=config.seed)
    return run_dir, model_dir


def test_eval_writes_into_the_evaluated_run_and_times_out_rewards(evaluated_run, tmp_path):
    run_dir, model_dir = evaluated_run
    rows = [("1+2=", "spin"), ("2+2=", "4"), ("3+1=", "4"), ("0+0=", "0")]
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": y}) + "\n" for p, y in rows))
    config_run = tmp_path / "config_run"  # the config's own run: must stay untouched
    start = time.monotonic()
    done = rl_eval(
        "--config",
        QUICKSTART,
        "--model",
        model_dir,
        "--dataset",
        data,
        "--logging.run_dir",
        config_run,
        "--rollout.reward",
        "stuck_rewards:stuck_reward",
        "--rollout.reward_timeout_s",
        "2",
        "--rollout.on_reward_error",
        "skip",
        "--eval.samples_per_prompt",
        "2",
        "--eval.pass_k",
        "[1, 2]",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - start < EVAL_BOUND_S
    summary = json.loads((run_dir / "eval_summary.json").read_text())
    assert summary == json.loads(done.stdout)
    metrics = summary["metrics"]
    assert metrics["eval/reward_timeouts"] == 2.0  # the "spin" prompt's 2 samples, killed
    assert metrics["eval/reward_errors"] == 0.0 and summary["datasets"] == {"eval": 4}
    assert 0.0 <= metrics["eval/eval/pass@2"] <= 1.0
    assert (run_dir / "eval_logs").is_dir() and not config_run.exists()


def test_a_model_outside_any_run_needs_output(evaluated_run, tmp_path):
    _, model_dir = evaluated_run
    bare = shutil.copytree(model_dir, tmp_path / "downloaded_model")
    refused = rl_eval(
        "--config",
        QUICKSTART,
        "--model",
        bare,
        "--dataset",
        ROOT / "examples/quickstart/data/train.jsonl",
        "--logging.run_dir",
        tmp_path / "config_run",
        timeout=60,
    )
    assert refused.returncode == 2 and refused.stdout == ""
    (line,) = refused.stderr.strip().splitlines()
    assert line.startswith("rl-eval: error: --model") and "give --output FILE" in line
    assert not (tmp_path / "config_run").exists() and not (bare / "eval_summary.json").exists()
