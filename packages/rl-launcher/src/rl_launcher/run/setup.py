"""Everything a run holds, started in order and stopped in reverse: the starting model,
the prompt source, Ray and its placement group, the training actor group (rl-fsdp or
rl-megatron) and the rollout manager (embedded or SGLang engines + router). Colocated on
GPUs, trainer and engines then take turns (:mod:`rl_launcher.run.colocation`)."""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_launcher.run import stopping
from rl_launcher.run.weight_sync import sync_options
from rl_launcher.run_log import MetricsLog, startup_phase


@dataclass(kw_only=True)
class Run:
    config: Any
    source: Any
    trainer: Any = None
    rollout: Any = None
    metrics_log: MetricsLog
    sync_options: dict = field(default_factory=dict)
    num_ranks: int = 1  # data-parallel ranks: the step is split into this many batches
    plan: Any = None  # placement.PlacementPlan
    placement: Any = None  # ray_placement.OrderedPlacement
    engine_sites: Any = None  # engine_hosts.EngineSites: where the engines start (RL runs)
    weight_version: int = 0  # the version the engines were last synced to
    critic: Any = None  # PPO's critic group (rl_launcher.run.critic), when the algorithm has one
    extras: dict = field(default_factory=dict)  # state of optional features (e.g. the evaluator)
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


def check_fresh(config, run_dir: Path) -> None:
    """A new run never mixes its metrics or checkpoints with an earlier run's."""
    from rl_launcher.run.checkpoints import checkpoint_dir
    from rl_launcher.run_log import METRICS_FILE

    if config.checkpoint.resume:
        return
    checkpoints = checkpoint_dir(config)  # made empty by rl_launcher.run_dirs before the run
    if (run_dir / METRICS_FILE).exists() or (checkpoints.is_dir() and any(checkpoints.iterdir())):
        raise ValueError(
            f"{run_dir} already holds a run; pass --resume to continue it, or set "
            "logging.run_dir to a new directory (or delete the old one)"
        )


def start_run(config) -> Run:
    from rl_launcher.data import build_prompt_source
    from rl_launcher.run.critic import start_critic
    from rl_launcher.run.model_setup import precision_note, prepare_model

    if config.rollout.replay_dir:  # train only, on dumped rollouts: no engines, no prompts
        from rl_launcher.run.modes import start_replay_run

        return start_replay_run(config)
    run_dir = Path(config.logging.run_dir)
    check_fresh(config, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with startup_phase("model and prompts ready", show=config.logging.progress):
        model_dir, tokenizer = prepare_model(config.model, run_dir=run_dir, seed=config.seed)
        source = build_prompt_source(config.data, seed=config.seed, tokenizer=tokenizer)
    precision_note(config)  # float32 on CUDA without TF32: one line, once
    run = Run(config=config, source=source, metrics_log=MetricsLog(run_dir, logging=config.logging),
              sync_options=sync_options(config, run_dir))  # fmt: skip
    run._cleanup.append(run.metrics_log.close)
    _start_gpu_monitor(run)
    try:
        _start_trainer(run, model_dir)
        start_critic(run, model_dir)  # PPO with a critic (gae) only
        _start_rollout(run, model_dir, tokenizer, run_dir)
    except BaseException:
        run.close()
        raise
    return run


def _start_gpu_monitor(run: Run) -> None:
    """GPU utilisation per step (``gpu/*`` metrics) on CUDA runs with nvidia-smi."""
    from rl_launcher.run.gpu_monitor import start_gpu_monitor

    if (monitor := start_gpu_monitor(run.config.cluster.device)) is not None:
        run.extras["gpu_monitor"] = monitor
        run._cleanup.append(monitor.close)


def _start_trainer(run: Run, model_dir: Path) -> None:
    import ray

    from rl_launcher.placement import plan_from_config
    from rl_launcher.ray_cluster import connect
    from rl_launcher.ray_placement import create_placement
    from rl_launcher.run.backends import backend_spec
    from rl_launcher.run.feeds import engines_beside_training
    from rl_launcher.run.shared_dirs import check_shared_dirs
    from rl_launcher.run.train_group import TrainGroup

    config = run.config
    plan, cluster = plan_from_config(config), config.cluster
    spec = backend_spec(config, model_dir=model_dir, num_ranks=plan.num_train_ranks)
    use_gpu = cluster.device == "cuda"
    cpus = max(os.cpu_count() or 1, plan.num_bundles * cluster.cpus_per_bundle)
    show = config.logging.progress
    with stopping.ray_starting(), startup_phase("Ray ready", show=show):  # stop signals: ours
        if connect(cluster.ray_address, num_cpus=int(cpus)) == "started":
            run._cleanup.append(ray.shutdown)
    placement = create_placement(plan, use_gpu=use_gpu, cpus_per_bundle=cluster.cpus_per_bundle,
                                 devices_per_node=cluster.devices_per_node)  # fmt: skip
    run._cleanup.append(placement.remove)
    run.plan, run.placement = plan, placement
    _place_engines(run)
    check_shared_dirs(run)  # over several nodes: run, checkpoint, sync and model dirs shared
    slots = list(plan.train_bundles)
    # colocated on GPU, the engine shares the rank's device: the actor takes half of it
    num_gpus = (0.5 if plan.colocate else 1.0) if use_gpu else 0
    # CPU threads: the node's cores are shared with engines generating beside training
    sharing = min(len(slots), cluster.devices_per_node) + engines_beside_training(config)
    with startup_phase(f"trainer ready ({config.backend.name}, {len(slots)} rank(s))", show=show):
        run.trainer = TrainGroup(spec, placement, slots, num_cpus=cluster.cpus_per_bundle,
                                 num_gpus=num_gpus, ranks_per_node=sharing)  # fmt: skip
    run._cleanup.append(run.trainer.shutdown)
    run.num_ranks = run.trainer.num_data_ranks


def _place_engines(run: Run) -> None:
    """Print the layout (which node runs which training rank and engine) and, for runs
    with engines, check where they will start before anything does
    (:func:`rl_launcher.run.engine_hosts.engine_sites`)."""
    from rl_launcher.ray_placement import describe_layout
    from rl_launcher.run.engine_hosts import engine_sites

    config = run.config
    with_engines = config.mode != "sft" and not config.rollout.replay_dir
    if config.logging.progress:
        layout = describe_layout(run.plan, run.placement, engines=with_engines)
        print("rl-train: layout (T<r> training rank r, E<e> engine e, one cell per device):\n"
              + "\n".join(f"rl-train:   {line}" for line in layout.splitlines()), flush=True)  # fmt: skip
    if with_engines:
        transport = run.sync_options["transport"]
        run.engine_sites = engine_sites(config, run.plan, run.placement, transport=transport)


def watch_engines(run: Run) -> None:
    from rl_launcher.run import engine_health

    engine_health.watch_engines(run)


def _start_rollout(run: Run, model_dir: Path, tokenizer, run_dir: Path) -> None:
    from rl_launcher.run.colocation import check_turns, make_turns, turns_needed
    from rl_launcher.run.rollout_manager import RolloutManager

    run.rollout = RolloutManager(run.config, model_dir=model_dir, tokenizer=tokenizer,
                                 source=run.source, log_dir=run_dir / "logs")  # fmt: skip
    run.rollout.sites = run.engine_sites  # each engine on its node, by a Ray actor
    if turns_needed(run.config, run.plan):
        check_turns(run.config)
        run.rollout.turns = run.trainer.turns = make_turns(run.config, run.trainer, run.rollout)
    run._cleanup.append(run.rollout.stop)
    engine = run.config.engine
    router = " and router" if engine.use_router else ""
    what = f"{engine.num_engines} {engine.kind} engine(s){router}"
    with startup_phase(f"{what} ready", show=run.config.logging.progress):
        run.rollout.start()
    watch_engines(run)
