"""Everything a run holds, started in order and stopped in reverse: the starting model,
the prompt source, Ray and its placement group, the training actor group and the rollout
manager (engines + router)."""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_launcher.run_log import MetricsLog

SYNC_TRANSPORTS = {"auto": "tensor", "tensor": "tensor", "disk": "disk"}


@dataclass(kw_only=True)
class Run:
    config: Any
    source: Any
    trainer: Any = None
    rollout: Any = None
    metrics_log: MetricsLog
    sync_options: dict = field(default_factory=dict)
    num_ranks: int = 1
    _cleanup: list = field(default_factory=list)

    def close(self) -> None:
        """Stop what was started, newest first; every part is stopped even if one fails."""
        errors = []
        while self._cleanup:
            try:
                self._cleanup.pop()()
            except Exception as error:  # keep stopping the rest, then report
                errors.append(error)
        if errors:
            raise errors[0]


def sync_options(config, run_dir: Path) -> dict:
    """How weights reach the engines; engines are local processes of this host."""
    transport = SYNC_TRANSPORTS.get(config.engine.weight_sync)
    if transport is None:
        raise ValueError(
            f"engine.weight_sync={config.engine.weight_sync!r} is not wired into rl-train yet; "
            "use auto, tensor or disk"
        )
    return {"transport": transport, "bucket_bytes": config.engine.weight_bucket_bytes,
            "path": str(run_dir / "sync_weights")}  # fmt: skip


def check_fresh(config, run_dir: Path) -> None:
    """A new run never mixes its metrics or checkpoints with an earlier run's."""
    from rl_launcher.run.checkpoints import checkpoint_dir
    from rl_launcher.run_log import METRICS_FILE

    if config.checkpoint.resume:
        return
    if (run_dir / METRICS_FILE).exists() or checkpoint_dir(config).exists():
        raise ValueError(
            f"{run_dir} already holds a run; pass --resume to continue it, or set "
            "logging.run_dir to a new directory (or delete the old one)"
        )


def start_run(config) -> Run:
    from rl_launcher.data import build_prompt_source
    from rl_launcher.run.model_setup import prepare_model

    run_dir = Path(config.logging.run_dir)
    check_fresh(config, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir, tokenizer = prepare_model(config.model, run_dir=run_dir, seed=config.seed)
    source = build_prompt_source(config.data, seed=config.seed, tokenizer=tokenizer)
    run = Run(config=config, source=source, metrics_log=MetricsLog(run_dir),
              sync_options=sync_options(config, run_dir))  # fmt: skip
    try:
        _start_trainer(run, model_dir)
        _start_rollout(run, model_dir, tokenizer, run_dir)
    except BaseException:
        run.close()
        raise
    return run


def _start_trainer(run: Run, model_dir: Path) -> None:
    import ray

    from rl_launcher.placement import plan_from_config
    from rl_launcher.ray_cluster import connect
    from rl_launcher.ray_placement import create_placement
    from rl_launcher.run.train_group import TrainGroup, fsdp_config

    config = run.config
    if config.backend.name != "fsdp":
        raise ValueError("backend.name=megatron is not wired into rl-train yet; use fsdp")
    plan, cluster = plan_from_config(config), config.cluster
    use_gpu = cluster.device == "cuda"
    cpus = max(os.cpu_count() or 1, plan.num_bundles * cluster.cpus_per_bundle)
    if connect(cluster.ray_address, num_cpus=int(cpus)) == "started":
        run._cleanup.append(ray.shutdown)
    placement = create_placement(plan, use_gpu=use_gpu, cpus_per_bundle=cluster.cpus_per_bundle,
                                 devices_per_node=cluster.devices_per_node)  # fmt: skip
    run._cleanup.append(placement.remove)
    slots = list(plan.train_bundles)
    # colocated on GPU, the engine shares the rank's device: the actor takes half of it
    num_gpus = (0.5 if plan.colocate else 1.0) if use_gpu else 0
    run.trainer = TrainGroup(fsdp_config(config, model_dir=model_dir), placement, slots,
                             num_cpus=cluster.cpus_per_bundle, num_gpus=num_gpus,
                             ranks_per_node=min(len(slots), cluster.devices_per_node))  # fmt: skip
    run._cleanup.append(run.trainer.shutdown)
    run.num_ranks = len(slots)


def _start_rollout(run: Run, model_dir: Path, tokenizer, run_dir: Path) -> None:
    from rl_launcher.run.rollout_manager import RolloutManager

    run.rollout = RolloutManager(run.config, model_dir=model_dir, tokenizer=tokenizer,
                                 source=run.source, log_dir=run_dir / "logs")  # fmt: skip
    run._cleanup.append(run.rollout.stop)
    run.rollout.start()
