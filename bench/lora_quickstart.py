"""LoRA against full fine-tuning on the quickstart (CPU): what trains, what the optimizer
holds, what a weight sync sends and how long it takes, time per step and the reward
curve's ends.

    uv run --package rl-launcher python bench/lora_quickstart.py [--steps 100] \
        [--runs-dir /tmp/lora_bench] [--reuse]

Runs ``rl-train`` side by side (so they share the machine's load) on
examples/quickstart/config.yaml (full, the baseline), on examples/quickstart/lora.yaml
(rank 8, the engines getting the adapters alone: ``model.lora_sync: adapter``) and on the
same with ``model.lora_sync=merged`` (the merged weights, every base weight each sync),
each for ``--steps`` steps (``--reuse``: read the run directories a previous call left),
then builds the full and LoRA trainers in this process (one CPU rank) and takes one
optimizer step to count trainable parameters and AdamW state bytes. Prints one JSON
object: per run the figures, and each LoRA arm over full.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"full": "examples/quickstart/config.yaml", "lora": "examples/quickstart/lora.yaml"}
# run name -> (config, overrides): the baseline and the two ways LoRA reaches the engines
ARMS = {
    "full": (CONFIGS["full"], []),
    "lora": (CONFIGS["lora"], []),
    "lora_merged": (CONFIGS["lora"], ["model.lora_sync=merged"]),
}
EDGE = 10  # steps averaged at each end of the reward curve
STARTS = 3  # tries of each run's start


def start_training(name: str, run_dir: Path, steps: int) -> subprocess.Popen:
    config, overrides = ARMS[name]
    cmd = [
        sys.executable,
        "-m",
        "rl_launcher.cli",
        "--config",
        config,
        f"num_steps={steps}",
        f"logging.run_dir={run_dir}",
        *overrides,
    ]
    return subprocess.Popen(cmd, cwd=ROOT)


def train_side_by_side(runs_dir: Path, steps: int) -> None:
    """Every arm at once, each started once the one before has finished its first step
    (three local Ray clusters starting together timed out on a loaded 2-core machine)."""
    runs = {}
    for name in ARMS:
        for _ in range(STARTS):  # Ray's 30 s start-up wait can run out under heavy load
            shutil.rmtree(runs_dir / name, ignore_errors=True)
            runs[name] = start_training(name, runs_dir / name, steps)
            while runs[name].poll() is None and not (runs_dir / name / "metrics.jsonl").exists():
                time.sleep(2)
            if runs[name].poll() in (None, 0):
                break
    failed = [name for name, process in runs.items() if process.wait() != 0]
    if failed:
        raise RuntimeError(f"rl-train failed for {failed}; see the output above")


def run_figures(run_dir: Path) -> dict:
    """Per-step medians, sync bytes and the reward at both ends of ``metrics.jsonl``
    (the step-0 eval record, if any, left out)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    records = [r for r in records if "time/sync" in r]
    rewards = [r["rollout/reward/mean"] for r in records]
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    figures = {
        "steps": len(records),
        "step_s_median": statistics.median(r["time/step"] for r in records),
        "train_s_median": statistics.median(r["time/train"] for r in records),
        "sync_s_median": statistics.median(r["time/sync"] for r in records),
        "sync_export_s_median": statistics.median(r["time/sync_export"] for r in records),
        "sync_bytes": records[-1]["sync/bytes"],
        f"reward_first_{EDGE}": statistics.fmean(rewards[:EDGE]),
        f"reward_last_{EDGE}": statistics.fmean(rewards[-EDGE:]),
    }
    if checkpoints:
        dcp_dir = checkpoints[-1] / "trainer" / "dcp"
        figures["checkpoint_tensor_bytes"] = checkpoint_tensor_bytes(dcp_dir)
    return figures


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

    if not args.reuse:
        train_side_by_side(args.runs_dir, args.steps)
    figures = {name: run_figures(args.runs_dir / name) for name in ARMS}
    init_distributed(device="cpu")
    for name in CONFIGS:
        figures[name] |= trainer_figures(name, args.runs_dir / name)
    ratio_keys = (
        "trainable_params",
        "optimizer_state_bytes",
        "sync_bytes",
        "sync_s_median",
        "step_s_median",
        "checkpoint_tensor_bytes",
    )
    for name in ("lora", "lora_merged"):
        arm, full = figures[name], figures["full"]
        figures[f"{name}_over_full"] = {
            k: arm[k] / full[k] for k in ratio_keys if k in arm and k in full
        }
    figures["hardware"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    figures["command"] = " ".join(["python bench/lora_quickstart.py", *sys.argv[1:]])
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
