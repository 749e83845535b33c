"""LoRA against full fine-tuning on the quickstart (CPU): what trains, what the optimizer
holds, what a weight sync sends and how long it takes, time per step and the reward
curve's ends.

    uv run --package rl-launcher python bench/lora_quickstart.py [--base random|sft] \
        [--steps 100] [--seeds 1] [--sft-steps 20] [--runs-dir /tmp/lora_bench] [--reuse]

``--base random`` (the default) trains the quickstart's randomly initialised model:
examples/quickstart/config.yaml (full, the baseline), examples/quickstart/lora.yaml (rank
8, the engines getting the adapters alone: ``model.lora_sync: adapter``) and the same with
``model.lora_sync=merged`` (the merged weights, every base weight each sync). ``--base sft``
first builds a trained base as a user would, the SFT stage of examples/sft_then_grpo
(sft.yaml for ``--sft-steps`` steps, its HF export), then runs GRPO from it with full
fine-tuning (grpo.yaml, lr 1e-3) and with rank-8 LoRA (grpo_lora.yaml, lr 3e-3), the same
config otherwise, once per seed of ``--seeds``, evaluation off.

Every GRPO run goes side by side (so they share the machine's load) for ``--steps`` steps
(``--reuse``: read the run directories a previous call left); then the full and LoRA
trainers are built in this process (one CPU rank) and take one optimizer step to count
trainable parameters and AdamW state bytes. Prints one JSON object: per run the figures,
per arm their mean over seeds, and each LoRA arm over full.
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
# base -> arm -> (config, overrides); the first arm is the baseline
ARMS = {
    "random": {
        "full": ("examples/quickstart/config.yaml", []),
        "lora": ("examples/quickstart/lora.yaml", []),
        "lora_merged": ("examples/quickstart/lora.yaml", ["model.lora_sync=merged"]),
    },
    "sft": {
        "full": ("examples/sft_then_grpo/grpo.yaml", ["eval.interval=0"]),
        "lora": ("examples/sft_then_grpo/grpo_lora.yaml", ["eval.interval=0"]),
    },
}
SFT_CONFIG = "examples/sft_then_grpo/sft.yaml"
EDGE = 10  # steps averaged at each end of the reward curve
STARTS = 3  # tries of each run's start


def rl_train(config: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "rl_launcher.cli", "--config", config, *overrides]


def sft_base(runs_dir: Path, steps: int, reuse: bool) -> Path:
    """The SFT stage's HF export after ``steps`` steps (trained here unless reused)."""
    run_dir = runs_dir / "sft"
    export = run_dir / "checkpoints" / f"step_{steps:06d}" / "hf"
    overrides = [f"num_steps={steps}", f"checkpoint.interval={steps}"]
    overrides.append(f"logging.run_dir={run_dir}")
    for _ in range(0 if reuse else STARTS):  # Ray's start-up wait can run out under load
        shutil.rmtree(run_dir, ignore_errors=True)
        if subprocess.run(rl_train(SFT_CONFIG, overrides), cwd=ROOT).returncode == 0:
            break
    if not export.is_dir():
        raise RuntimeError(f"the SFT stage left no {export}; see the output above")
    return export


def plan_runs(base: str, seeds: list[int], base_dir: Path | None) -> dict[str, tuple]:
    """Run name -> (config, overrides): each arm once, or once per seed from ``base_dir``."""
    if base_dir is None:
        return ARMS[base]
    runs = {}
    for seed in seeds:
        for arm, (config, overrides) in ARMS[base].items():
            extra = [f"model.path={base_dir}", f"seed={seed}"]
            runs[f"{arm}_seed{seed}"] = (config, [*overrides, *extra])
    return runs


def start_training(run: tuple, run_dir: Path, steps: int) -> subprocess.Popen:
    config, overrides = run
    cmd = rl_train(config, [f"num_steps={steps}", f"logging.run_dir={run_dir}", *overrides])
    return subprocess.Popen(cmd, cwd=ROOT)


def train_side_by_side(runs_dir: Path, steps: int, plan: dict) -> None:
    """Every run at once, each started once the one before has finished its first step
    (three local Ray clusters starting together timed out on a loaded 2-core machine)."""
    runs = {}
    for name, run in plan.items():
        for _ in range(STARTS):  # Ray's 30 s start-up wait can run out under heavy load
            shutil.rmtree(runs_dir / name, ignore_errors=True)
            runs[name] = start_training(run, runs_dir / name, steps)
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


def trainer_figures(config_path: str, overrides: list[str], model_dir: Path) -> dict:
    """Trainable parameters and AdamW state bytes of a run's trainer after one step."""
    import torch

    from rl_core.batch import TrainBatch
    from rl_core.packing import cu_seqlens_from_lengths
    from rl_fsdp import FSDPBackend
    from rl_launcher.config.loader import load_config
    from rl_launcher.roles.backends import fsdp_config

    config, _ = load_config(["--config", str(ROOT / config_path), *overrides])
    backend = FSDPBackend(fsdp_config(config, model_dir=model_dir))
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


def arm_means(figures: dict, arms, seeds: list[int]) -> dict:
    """Per arm, the mean over seeds of each figure every seed's run has."""
    means = {}
    for arm in arms:
        runs = [figures[f"{arm}_seed{seed}"] for seed in seeds]
        keys = set.intersection(*(set(run) for run in runs))
        means[arm] = {k: statistics.fmean(run[k] for run in runs) for k in sorted(keys)}
    return means


RATIO_KEYS = (
    "trainable_params",
    "optimizer_state_bytes",
    "sync_bytes",
    "sync_s_median",
    "step_s_median",
    "checkpoint_tensor_bytes",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", choices=sorted(ARMS), default="random")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="with --base sft")
    parser.add_argument("--sft-steps", type=int, default=20, help="with --base sft")
    parser.add_argument("--runs-dir", type=Path, default=Path("/tmp/lora_bench"))
    parser.add_argument("--reuse", action="store_true", help="read existing run directories")
    args = parser.parse_args()
    from rl_core.distributed import init_distributed

    base_dir = sft_base(args.runs_dir, args.sft_steps, args.reuse) if args.base == "sft" else None
    plan = plan_runs(args.base, args.seeds, base_dir)
    if not args.reuse:
        train_side_by_side(args.runs_dir, args.steps, plan)
    figures = {name: run_figures(args.runs_dir / name) for name in plan}
    init_distributed(device="cpu")
    for name, (config_path, overrides) in plan.items():
        if name.startswith(("full", "lora")) and "merged" not in name:
            model_dir = base_dir or args.runs_dir / name / "initial_model"
            figures[name] |= trainer_figures(config_path, overrides, model_dir)
    arms = figures if base_dir is None else arm_means(figures, ARMS["sft"], args.seeds)
    if base_dir is not None:
        figures["mean_over_seeds"] = arms
    for arm in [name for name in ARMS[args.base] if name != "full"]:
        figures[f"{arm}_over_full"] = {
            k: arms[arm][k] / arms["full"][k]
            for k in RATIO_KEYS
            if k in arms[arm] and k in arms["full"]
        }
    figures["hardware"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    figures["command"] = " ".join(["python bench/lora_quickstart.py", *sys.argv[1:]])
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
