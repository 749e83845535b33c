"""A run's start-up, in order, each part stopped in reverse by :meth:`Run.close`: the
starting model, the prompt source, Ray and its placement group, the training actor group
(rl-fsdp or rl-megatron) and the rollout manager (embedded or SGLang engines + router).
Colocated on GPUs, trainer and engines then take turns (:mod:`rl_launcher.infra.colocation`).

- :func:`start_run`: an RL run (a train-only replay of dumped rollouts with
  ``rollout.replay_dir``: :func:`start_replay_run`);
- :func:`start_trainer`: Ray, the placement and the training actor group (SFT uses it alone);
- :func:`start_engines`: a rollout manager with its engines and router, no Ray and no
  trainer (rollout-only runs and ``rl-eval``).
"""

import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from rl_launcher.infra import stopping
from rl_launcher.infra.run_log import MetricsLog, startup_phase
from rl_launcher.infra.weight_sync import sync_options
from rl_launcher.session.run import Run, check_fresh, check_teacher, new_run


def start_run(config) -> Run:
    from rl_launcher.roles.critic import start_critic
    from rl_launcher.roles.teacher import start_teacher
    from rl_launcher.session.model import given_model_dir, precision_note

    if config.rollout.replay_dir:  # train only, on dumped rollouts: no engines, no prompts
        return start_replay_run(config)
    check_teacher(config)  # distill.teacher_path, before anything starts
    run_dir = Path(config.logging.run_dir)
    check_fresh(config, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # an HF directory given as model.path is used as is: engines and trainer start from it
    # while the tokenizer and the prompts load beside them; a model built here needs both
    model_dir, tokenizer, source = given_model_dir(config.model), None, None
    if model_dir is None:
        model_dir, tokenizer, source = _model_and_prompts(config, run_dir)
    precision_note(config)  # float32 on CUDA without TF32: one line, once
    run = Run(
        config=config,
        source=source,
        metrics_log=MetricsLog(run_dir, logging=config.logging),
        sync_options=sync_options(config, run_dir),
    )
    run._cleanup.append(run.metrics_log.close)
    _start_gpu_monitor(run)

    def rollout():
        nonlocal tokenizer
        if run.source is None:  # loaded while the trainer starts
            _, tokenizer, run.source = _model_and_prompts(config, run_dir)
        _start_rollout(run, model_dir, tokenizer, run_dir)

    try:
        _launch_engines_first(run, model_dir, run_dir)
        start_trainer(run, model_dir, meanwhile=None if _takes_turns(config) else rollout)
        start_critic(run, model_dir)  # PPO with a critic (gae) only
        if run.rollout is None:  # colocated GPUs: the engines start once the trainer is up
            rollout()
        start_teacher(run)  # distill.*: an engine that scores the samples, or its URL
    except BaseException:
        run.close()
        raise
    return run


def _model_and_prompts(config, run_dir: Path):
    """``(model_dir, tokenizer, prompt source)`` of an RL run (:func:`prepare_model`)."""
    from rl_launcher.data import build_prompt_source
    from rl_launcher.session.model import prepare_model

    with startup_phase("model and prompts ready", show=config.logging.progress):
        model_dir, tokenizer = prepare_model(config.model, run_dir=run_dir, seed=config.seed)
        source = build_prompt_source(config.data, seed=config.seed, tokenizer=tokenizer)
    return model_dir, tokenizer, source


def _takes_turns(config) -> bool:
    """Trainer and engines share GPUs (colocated): each must see the other's memory when
    it starts, so they start one after the other."""
    from rl_launcher.infra.colocation import turns_needed
    from rl_launcher.infra.placement import plan_from_config

    return turns_needed(config, plan_from_config(config))


def engines_start_first(config) -> bool:
    """Whether the engines start here, before Ray, loading while Ray and the training ranks
    start: a CPU run on this machine alone (Ray started here, one node) with the driver's
    data plane and no colocation turns. Elsewhere an engine's node and devices come from
    the placement, so the engines start once Ray has placed them."""
    from rl_launcher.infra.ray_cluster import cluster_address

    cluster = config.cluster
    return (
        cluster.device == "cpu"
        and cluster.num_nodes == 1
        and cluster_address(cluster.ray_address)[0] is None
        and config.rollout.data_plane == "driver"
        and not _takes_turns(config)
    )


def _launch_engines_first(run: Run, model_dir: Path, run_dir: Path) -> None:
    """With :func:`engines_start_first`, start the engine servers now, not yet waited for
    (:func:`_start_rollout` hands them to the pool); they are stopped with the run if it
    fails before the pool holds them."""
    from rl_launcher.infra.ray_cluster import starting_early
    from rl_launcher.roles.engine_pool import start_servers
    from rl_launcher.roles.rollout_manager import engine_batch_limit
    from rl_launcher.session.model import engine_model_dir

    config = run.config
    ray = sys.modules.get("ray")
    caller_ray = ray is not None and ray.is_initialized() and not starting_early()
    if not engines_start_first(config) or caller_ray:
        return  # (a Ray the caller started may span several nodes)
    if config.logging.progress:
        what = f"{config.engine.num_engines} {config.engine.kind} engine(s)"
        print(f"rl-train: {what} loading while Ray starts", flush=True)
    run.early_servers = start_servers(
        config,
        model_dir=engine_model_dir(config, model_dir),
        log_dir=run_dir / "logs",
        max_batch_size=engine_batch_limit(config),
    )

    def stop_unclaimed():
        if run.rollout is None:
            for server in run.early_servers:
                server.stop()

    run._cleanup.append(stop_unclaimed)


def start_replay_run(config) -> Run:
    """A train-only run on the dumps of ``rollout.replay_dir`` (no engines start): the
    training actor group and a :class:`~rl_launcher.infra.dumps.ReplayRollout` in place of
    the engines and the prompt source."""
    from rl_launcher.infra.dumps import ReplayRollout
    from rl_launcher.roles.critic import start_critic

    replay = ReplayRollout(
        config.rollout.replay_dir,
        group_size=config.rollout.group_size,
        fraction=config.rollout.replay_fraction,
        seed=config.seed,
    )
    run, model_dir, _ = new_run(config, lambda tokenizer: replay)
    run.rollout = replay
    try:
        start_trainer(run, model_dir)
        start_critic(run, model_dir)  # PPO with a critic (gae) only
    except BaseException:
        run.close()
        raise
    return run


def start_engines(
    config, *, model_dir, tokenizer, source, log_dir: Path, cleanup: list, reward=None
):
    """A rollout manager with its engines and router started, without Ray or a trainer
    (engines on the default devices); its stop is appended to ``cleanup``. ``reward``: a
    reward that exists already (see :class:`RolloutManager`)."""
    from rl_launcher.roles.rollout_manager import RolloutManager
    from rl_launcher.session.model import engine_model_dir

    manager = RolloutManager(
        config,
        model_dir=engine_model_dir(config, model_dir),  # engine.quantization=fp8: converted
        tokenizer=tokenizer,
        source=source,
        log_dir=log_dir,
        reward=reward,
    )
    cleanup.append(manager.stop)
    return manager.start()


def _start_gpu_monitor(run: Run) -> None:
    """GPU utilisation per step (``gpu/*`` metrics) on CUDA runs with nvidia-smi."""
    from rl_launcher.infra.gpu_monitor import start_gpu_monitor

    if (monitor := start_gpu_monitor(run.config.cluster.device)) is not None:
        run.extras["gpu_monitor"] = monitor
        run._cleanup.append(monitor.close)


def start_trainer(run: Run, model_dir: Path, meanwhile: Callable[[], None] | None = None) -> None:
    """Ray (started or attached), the placement group and the training actor group.
    ``meanwhile``: run on this thread while the training ranks start (the engines: each
    loads its model while the ranks load theirs; servers it starts stay tied to the main
    thread, see :func:`rl_launcher.infra.lifetime.tie_to_this_process`)."""
    from rl_launcher.infra.colocation import engines_beside_training
    from rl_launcher.infra.placement import plan_from_config
    from rl_launcher.infra.ray_cluster import connect, local_cpus, stop_local_ray
    from rl_launcher.infra.ray_placement import create_placement
    from rl_launcher.infra.shared_dirs import check_shared_dirs
    from rl_launcher.roles.backends import backend_spec
    from rl_launcher.roles.train_group import TrainGroup

    config = run.config
    plan, cluster = plan_from_config(config), config.cluster
    spec = backend_spec(config, model_dir=model_dir, num_ranks=plan.num_train_ranks)
    use_gpu = cluster.device == "cuda"
    show = config.logging.progress
    with stopping.ray_starting(), startup_phase("Ray ready", show=show):  # stop signals: ours
        started_here = connect(cluster.ray_address, num_cpus=local_cpus(config)) == "started"
        if started_here:
            run._cleanup.append(stop_local_ray)
    ray_env = dict(os.environ) if started_here else None  # what Ray's workers inherit
    placement = create_placement(
        plan,
        use_gpu=use_gpu,
        cpus_per_bundle=cluster.cpus_per_bundle,
        devices_per_node=cluster.devices_per_node,
    )
    run._cleanup.append(placement.remove)
    run.plan, run.placement = plan, placement
    _place_engines(run)
    check_shared_dirs(run)  # over several nodes: run, checkpoint, sync and model dirs shared
    slots = list(plan.train_bundles)
    # colocated on GPU, the engine shares the rank's device: the actor takes half of it
    num_gpus = (0.5 if plan.colocate else 1.0) if use_gpu else 0
    # CPU threads: the node's cores are shared with engines generating beside training
    sharing = min(len(slots), cluster.devices_per_node) + engines_beside_training(config)
    group = partial(
        TrainGroup,
        spec,
        placement,
        slots,
        num_cpus=cluster.cpus_per_bundle,
        num_gpus=num_gpus,
        ranks_per_node=sharing,
        inherited_env=ray_env,  # the ranks take workers that Ray prestarted
    )
    what = f"trainer ready ({config.backend.name}, {len(slots)} rank(s))"
    stopped_after = len(run._cleanup)  # what ``meanwhile`` starts (the engines)
    run.trainer = beside(group, meanwhile, what=what, show=show)
    # the engines stop first: they let go of the trainer's shared weight buffers, which
    # the ranks then free before they are killed (rl_launcher.infra.weight_sync)
    run._cleanup.insert(stopped_after, run.trainer.shutdown)
    run.num_ranks = run.trainer.num_data_ranks


def beside(build: Callable, meanwhile: Callable[[], None] | None, *, what: str, show: bool):
    """``build()``'s result, built on a worker thread while ``meanwhile()`` runs on this
    one (``build`` alone without it); ``what`` is said with ``build``'s time. When both
    fail, ``meanwhile``'s error is raised and ``build``'s chained to it."""
    if meanwhile is None:
        with startup_phase(what, show=show):
            return build()

    def timed_build():
        with startup_phase(what, show=show):
            return build()

    with ThreadPoolExecutor(1, thread_name_prefix="start-trainer") as pool:
        future = pool.submit(timed_build)
        try:
            meanwhile()
        except BaseException as error:
            if (built := future.exception()) is not None:
                raise error from built
            raise
        return future.result()


def _place_engines(run: Run) -> None:
    """Print the layout (which node runs which training rank and engine) and, for runs
    with engines, check where they will start before anything does
    (:func:`rl_launcher.roles.engine_hosts.engine_sites`)."""
    from rl_launcher.infra.ray_placement import describe_layout
    from rl_launcher.infra.weight_sync import engine_tp_ranks
    from rl_launcher.roles.engine_hosts import engine_sites

    config = run.config
    with_engines = config.mode == "rl" and not config.rollout.replay_dir
    if config.logging.progress:
        layout = describe_layout(run.plan, run.placement, engines=with_engines)
        print(
            "rl-train: layout (T<r> training rank r, E<e> engine e, one cell per device):\n"
            + "\n".join(f"rl-train:   {line}" for line in layout.splitlines()),
            flush=True,
        )
    if with_engines:
        transport = run.sync_options["transport"]
        run.engine_sites = engine_sites(config, run.plan, run.placement, transport=transport)
        run.sync_options["senders"] = list(run.engine_sites.senders)  # engine -> its rank
        if transport == "tensor":  # engine -> the rank on each of its devices, in TP order
            run.sync_options["tp_ranks"] = engine_tp_ranks(
                run.plan.engine_bundles, run.plan.train_bundles
            )


def watch_engines(run: Run) -> None:
    """Health checks and restarts of the engines (:meth:`EnginePool.watch`); a restarted
    engine gets the trainer's weights, exported to disk."""

    def export(path: str) -> bool:
        if run.trainer is None:  # still starting: never synced, start-up weights are current
            return False
        run.trainer.export_hf(path)
        if run.config.engine.quantization == "fp8":  # as the engines serve them
            from rl_sglang.fp8_checkpoint import write_fp8_checkpoint

            write_fp8_checkpoint(path, path)
        return True

    run.rollout.engines.watch(export=export, transport=run.sync_options.get("transport"))


def _start_rollout(run: Run, model_dir: Path, tokenizer, run_dir: Path) -> None:
    from rl_launcher.infra.colocation import check_turns, make_turns, turns_needed
    from rl_launcher.roles.buffer_rollout import BufferRollout
    from rl_launcher.roles.rollout_manager import RolloutManager
    from rl_launcher.session.model import engine_model_dir

    model_dir = engine_model_dir(run.config, model_dir)  # engine.quantization=fp8: converted
    kind, extra = RolloutManager, {}
    if run.config.rollout.source == "buffer":  # agent workers write the groups
        kind, extra = BufferRollout, {"run_dir": run_dir}
    run.rollout = kind(
        run.config,
        model_dir=model_dir,
        tokenizer=tokenizer,
        source=run.source,
        log_dir=run_dir / "logs",
        **extra,
    )
    engines = run.rollout.engines
    if run.early_servers:  # started here before Ray (engines_start_first)
        import ray

        engines.servers = run.early_servers
        engines.local_node = ray.get_runtime_context().get_node_id()
    else:
        engines.sites = run.engine_sites  # each engine on its node, by a Ray actor
    if turns_needed(run.config, run.plan):
        check_turns(run.config)
        engines.turns = run.trainer.turns = make_turns(run.config, run.trainer, engines)
    run._cleanup.append(run.rollout.stop)
    engine = run.config.engine
    router = " and router" if engine.use_router else ""
    what = f"{engine.num_engines} {engine.kind} engine(s){router}"
    with startup_phase(f"{what} ready", show=run.config.logging.progress):
        run.rollout.start()
    watch_engines(run)
