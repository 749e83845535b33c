"""LoRA against full fine-tuning on the quickstart (CPU): what trains, what the optimizer
holds, what a weight sync sends, time per step and the reward curve's ends.

    uv run --package rl-launcher python bench/lora_quickstart.py [--steps 100] \
        [--runs-dir /tmp/lora_bench] [--reuse]

Runs ``rl-train`` on examples/quickstart/config.yaml (full, the baseline) and on
examples/quickstart/lora.yaml (rank 8), both for ``--steps`` steps (``--reuse``: read
the run directories a previous call left), then builds each run's rl-fsdp trainer in this
process (one CPU rank) and takes one optimizer step to count its trainable parameters and
AdamW state bytes. Prints one JSON object: per run the figures, and LoRA / full ratios.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"full": "examples/quickstart/config.yaml", "lora": "examples/quickstart/lora.yaml"}
EDGE = 10  # steps averaged at each end of the reward curve


def train(name: str, run_dir: Path, steps: int) -> None:
    cmd = [
        sys.executable,
        "-m",
        "rl_launcher.cli",
        "--config",
        CONFIGS[name],
        f"num_steps={steps}",
        f"logging.run_dir={run_dir}",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True)


def run_figures(run_dir: Path) -> dict:
    """Per-step medians, sync bytes and the reward at both ends of ``metrics.jsonl``."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    rewards = [r["rollout/reward/mean"] for r in records]
    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "trainer"
    return {
        "steps": len(records),
        "step_s_median": statistics.median(r["time/step"] for r in records),
        "train_s_median": statistics.median(r["time/train"] for r in records),
        "sync_s_median": statistics.median(r["time/sync"] for r in records),
        "sync_bytes": records[-1]["sync/bytes"],
        f"reward_first_{EDGE}": statistics.fmean(rewards[:EDGE]),
        f"reward_last_{EDGE}": statistics.fmean(rewards[-EDGE:]),
        "checkpoint_tensor_bytes": checkpoint_tensor_bytes(last / "dcp"),
    }


def checkpoint_tensor_bytes(dcp_dir: Path) -> int:
    """Bytes of the tensors a trainer checkpoint holds (model and optimizer state; the
    files add torch.distributed.checkpoint's per-item metadata on top)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    return sum(
        m.properties.dtype.itemsize * m.size.numel()
        for m in metadata.values()
        if getattr(m, "size", None) is not None
    )


def trainer_figures(name: str, run_dir: Path) -> dict:
    """Trainable parameters and AdamW state bytes of the run's trainer after one step."""
    import torch

    from rl_core.batch import TrainBatch
    from rl_core.packing import cu_seqlens_from_lengths
    from rl_fsdp import FSDPBackend
    from rl_launcher.config.loader import load_config
    from rl_launcher.roles.backends import fsdp_config

    config, _ = load_config(["--config", str(ROOT / CONFIGS[name])])
    backend = FSDPBackend(fsdp_config(config, model_dir=run_dir / "initial_model"))
    tokens = torch.randint(0, 16, (24,), generator=torch.Generator().manual_seed(0))
    batch = TrainBatch(
        tokens=tokens,
        cu_seqlens=cu_seqlens_from_lengths([12, 12]),
        loss_mask=torch.ones(24),
        advantages=torch.randn(24),
    )
    backend.train_step(batch.with_global_denominators())
    state = backend.optimizer.state.values()
    return {
        "params": sum(p.numel() for p in backend.model.parameters()),
        "trainable_params": sum(p.numel() for p in backend.model.parameters() if p.requires_grad),
        "optimizer_state_bytes": sum(t.nbytes for s in state for t in s.values() if t.dim()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--runs-dir", type=Path, default=Path("/tmp/lora_bench"))
    parser.add_argument("--reuse", action="store_true", help="read existing run directories")
    args = parser.parse_args()
    from rl_core.distributed import init_distributed

    figures = {}
    for name in CONFIGS:
        run_dir = args.runs_dir / name
        if not args.reuse:
            train(name, run_dir, args.steps)
        figures[name] = run_figures(run_dir)
    init_distributed(device="cpu")
    for name in CONFIGS:
        figures[name] |= trainer_figures(name, args.runs_dir / name)
    ratio_keys = (
        "trainable_params",
        "optimizer_state_bytes",
        "sync_bytes",
        "step_s_median",
        "checkpoint_tensor_bytes",
    )
    figures["lora_over_full"] = {k: figures["lora"][k] / figures["full"][k] for k in ratio_keys}
    figures["hardware"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    figures["command"] = " ".join(["python bench/lora_quickstart.py", *sys.argv[1:]])
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
