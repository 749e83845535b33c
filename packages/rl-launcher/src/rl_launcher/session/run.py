"""What a run holds (:class:`Run`), handed to every loop: the config, the data source, the
roles started for it (trainer, rollout, critic), its placement, metrics log and the
cleanups that stop them; and the checks and first steps every kind of run shares."""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_launcher.infra.checkpoints import checkpoint_dir
from rl_launcher.infra.run_log import METRICS_FILE, MetricsLog
from rl_launcher.infra.weight_sync import sync_options
from rl_launcher.session.model import prepare_model

if TYPE_CHECKING:  # the roles import Ray and the backends; a Run only holds them
    from rl_launcher.config.schema import TrainConfig
    from rl_launcher.data.source import PromptSource
    from rl_launcher.infra.dumps import ReplayRollout
    from rl_launcher.infra.placement import PlacementPlan
    from rl_launcher.infra.ray_placement import OrderedPlacement
    from rl_launcher.roles.critic import CriticGroup
    from rl_launcher.roles.engine_hosts import EngineSites
    from rl_launcher.roles.rollout_role import RolloutRole
    from rl_launcher.roles.train_group import TrainGroup


@dataclass(kw_only=True)
class Run:
    config: "TrainConfig"
    source: "PromptSource | ReplayRollout"  # a replay is its own source
    trainer: "TrainGroup | None" = None  # None in rollout-only runs
    rollout: "RolloutRole | None" = None  # None in SFT and DPO runs
    metrics_log: MetricsLog
    sync_options: dict[str, Any] = field(default_factory=dict)
    num_ranks: int = 1  # data-parallel ranks: the step is split into this many batches
    plan: "PlacementPlan | None" = None  # under Ray
    placement: "OrderedPlacement | None" = None  # under Ray
    engine_sites: "EngineSites | None" = None  # where the engines start (RL runs under Ray)
    early_servers: list = field(default_factory=list)  # engines started before Ray, here
    critic: "CriticGroup | None" = None  # PPO's critic, when the algorithm has one
    extras: dict[str, Any] = field(default_factory=dict)  # optional features (the evaluator)
    _cleanup: list[Callable[[], None]] = field(default_factory=list)

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
    if config.checkpoint.resume:
        return
    checkpoints = checkpoint_dir(config)  # made empty by infra.run_dirs before the run
    if (run_dir / METRICS_FILE).exists() or (checkpoints.is_dir() and any(checkpoints.iterdir())):
        raise ValueError(
            f"{run_dir} already holds a run; pass --resume to continue it, or set "
            "logging.run_dir to a new directory (or delete the old one)"
        )


def check_teacher(config) -> None:
    """``distill.teacher_path`` is an HF model directory; checked when the run starts,
    before Ray (a config may name one that an earlier run has yet to write)."""
    path = config.distill.teacher_path
    if config.distill.coef > 0 and path and not Path(path, "config.json").is_file():
        raise ValueError(
            f"distill.teacher_path={path} has no config.json: give an HF model directory "
            "(e.g. checkpoints/step_N/hf of a run with checkpoint.save_hf)"
        )


def check_before_start(config) -> None:
    """What an RL run with a trainer checks before it starts anything, checked by
    ``rl-train`` before its Ray begins to start (:func:`rl_launcher.infra.ray_cluster.
    start_early`): the loop's settings, ``--resume``, a fresh run directory, the teacher's
    directory, and the model and prompt files it reads while Ray starts. The loop checks
    them again for the callers that run it directly; other runs check their own."""
    from rl_launcher.config.checks import check_loop
    from rl_launcher.data.reader import check_exists
    from rl_launcher.infra import resume_choice
    from rl_launcher.session.model import check_model_paths

    if config.mode != "rl" or config.rollout.rollout_only:
        return
    check_loop(config)
    check_teacher(config)
    resume_choice.chosen(config)
    check_fresh(config, Path(config.logging.run_dir))
    check_model_paths(config.model)
    if config.data.source is None and not config.rollout.replay_dir:  # else no prompt files
        for dataset in config.data.train:
            check_exists(dataset.path)


def new_run(config, source_fn):
    """A Run with its model prepared and a metrics log; ``source_fn(tokenizer)`` gives the source."""
    run_dir = Path(config.logging.run_dir)
    check_fresh(config, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model_dir, tokenizer = prepare_model(config.model, run_dir=run_dir, seed=config.seed)
    run = Run(
        config=config,
        source=source_fn(tokenizer),
        metrics_log=MetricsLog(run_dir, logging=config.logging),
        sync_options=sync_options(config, run_dir),
    )
    run._cleanup.append(run.metrics_log.close)
    return run, model_dir, tokenizer
