"""rl-train with LoRA (examples/quickstart/lora.yaml, shrunk) on CPU with real Ray, an
embedded engine behind sglang-router and rl-fsdp: each sync sends the engine the adapters
alone (model.lora_sync: adapter, a PEFT directory loaded under a new name per version) and
its log-probs with them equal the trainer's adapted model, versions advance every step,
the KL reference is the frozen base, checkpoints hold only the adapters, and the HF export
changes only the adapted layers."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from rl_launcher.cli import main
from rl_launcher.infra.run_log import read_metrics

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]
LORA = ROOT / "examples" / "quickstart" / "lora.yaml"
LOGPROB_TOL = 1e-4
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# rank 8 on 2 layers of hidden 64, k and v 32 wide (2 heads x 16), MLP 128: r x (in + out) per Linear
NUM_ADAPTER = 2 * 8 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 128))


def test_lora_run_syncs_adapters_and_checkpoints_only_adapters(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "--config",
        str(LORA),
        "--num_steps",
        "3",
        "--rollout.batch_size",
        "4",
        "--rollout.group_size",
        "4",
        "--algorithm.entropy_coef",
        "0.1",
        "--algorithm.kl_coef",
        "0.01",
        "--logging.run_dir",
        str(run_dir),
        "--model.tokenizer_path",
        str(ROOT / "examples/quickstart/tokenizer"),
        "--data.train.0.path",
        str(ROOT / "examples/quickstart/data/train.jsonl"),
        "--checkpoint.interval",
        "2",
        "--checkpoint.save_hf",
        "true",
    ]
    assert main(args) == 0
    records = read_metrics(run_dir)
    assert [r["sync/weight_version"] for r in records] == [1.0, 2.0, 3.0]
    assert [r["rollout/weight_version_min"] for r in records] == [0.0, 1.0, 2.0]
    # the engine's base plus the adapter it loaded gives the trainer's adapted log-probs
    assert all(r["mismatch/logprob_abs_diff_max"] < LOGPROB_TOL for r in records)
    assert records[2]["loss/kl"] > 0  # the adapters moved the policy off the base (reference)
    base = load_file(run_dir / "initial_model" / "model.safetensors")
    assert all(r["sync/bytes"] == 4 * NUM_ADAPTER for r in records)  # float32 adapters only
    synced = run_dir / "sync_weights" / "lora"  # the last two versions stay (older unloaded)
    assert sorted(p.name for p in synced.iterdir()) == ["policy_v2", "policy_v3"]
    sent = load_file(synced / "policy_v3" / "adapter_model.safetensors")
    assert len(sent) == 2 * 7 * 2 and sum(t.numel() for t in sent.values()) == NUM_ADAPTER

    step_dir = run_dir / "checkpoints" / "step_000003"
    trainer = step_dir / "trainer"
    assert json.loads((trainer / "adapter.json").read_text())["lora"]["rank"] == 8
    saved = dcp.FileSystemReader(str(trainer / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert len(model_keys) == 2 * 7 * 2 and all(
        k.endswith(("lora_A", "lora_B")) for k in model_keys
    )
    sizes = [math.prod(m.size) for m in saved.values() if getattr(m, "size", None)]
    assert sum(sizes) == 3 * NUM_ADAPTER  # adapters and AdamW's two moments, no base weight
    assert sum(t.numel() for t in base.values()) > 3 * NUM_ADAPTER

    merged = load_file(step_dir / "hf" / "model-00001.safetensors")
    assert merged.keys() == base.keys()
    changed = {name for name in base if not torch.equal(merged[name], base[name])}
    assert changed == {
        name for name in base if name.endswith(tuple(f"{t}.weight" for t in ADAPTED))
    }
