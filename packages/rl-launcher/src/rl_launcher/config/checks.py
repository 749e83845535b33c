"""Checks that span several fields of a :class:`TrainConfig` (single fields are checked
while it is built). Each raises ValueError naming the fields involved and a fix."""

from rl_launcher.config import TrainConfig
from rl_launcher.config.data_plane_checks import check_data_plane
from rl_launcher.config.extensions import check_extensions
from rl_launcher.config.fp8_checks import check_fp8_rollout
from rl_launcher.config.routing_checks import check_routing_replay
from rl_launcher.config.switch_checks import check_switches
from rl_launcher.infra.placement import plan_from_config
from rl_launcher.infra.weight_sync import resolve_transport

# Estimators whose baseline is the other samples of the prompt: a group of one sample has
# zero advantage (rloo refuses it), so nothing would be learnt from rewards.
GROUP_RELATIVE_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
# Estimators whose advantages never read the per-token KL (AdvantageInputs.kl), so a
# KL-shaped reward (algorithm.reward_kl_coef) would silently do nothing.
KL_BLIND_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def check_consistency(config: TrainConfig) -> None:
    checks = (
        _check_algorithm,
        _check_optimizer,
        _check_rollout,
        _check_sampling,
        _check_devices,
        _check_data,
        _check_eval,
        _check_modes,
        _check_distill,
        _check_lora,
        _check_megatron,
        check_routing_replay,  # algorithm.routing_replay (config/routing_checks.py)
        check_fp8_rollout,  # engine.quantization=fp8 (config/fp8_checks.py)
        check_extensions,  # user functions by dotted path: imported, signatures checked
        _check_rollout_function,
        _check_group_reward,
        check_switches,  # issue 31's algorithm switches (config/switch_checks.py)
        check_data_plane,  # rollout.data_plane=workers refuses what needs tokens on the driver
    )
    for check in checks:
        check(config)
    plan_from_config(config)  # raises when the device pool cannot hold the layout


def _check_algorithm(config: TrainConfig) -> None:
    estimator, group_size = config.algorithm.advantage_estimator, config.rollout.group_size
    trains_on_rewards = config.mode == "rl" and not config.rollout.rollout_only
    if trains_on_rewards and estimator in GROUP_RELATIVE_ESTIMATORS and group_size < 2:
        raise ValueError(
            f"algorithm.advantage_estimator={estimator} needs rollout.group_size >= 2 "
            f"(got {group_size}): its baseline is the other samples of the prompt, so a "
            "group of one has zero advantage and nothing is learnt; raise rollout.group_size "
            "or use reinforce_plus_plus"
        )
    reward_kl = config.algorithm.reward_kl_coef
    if trains_on_rewards and reward_kl > 0 and estimator in KL_BLIND_ESTIMATORS:
        raise ValueError(
            f"algorithm.reward_kl_coef={reward_kl} has no effect with "
            f"algorithm.advantage_estimator={estimator}, which ignores the per-token KL; use "
            "reinforce_plus_plus, reinforce_plus_plus_baseline or gae, or put the KL in the "
            "loss with algorithm.kl_coef (and reward_kl_coef=0)"
        )


def _check_optimizer(config: TrainConfig) -> None:
    betas = config.optimizer.betas
    if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"optimizer.betas must be two numbers in [0, 1), got {betas}")
    opt = config.optimizer
    if opt.momentum and opt.name != "sgd":
        raise ValueError(
            f"optimizer.momentum={opt.momentum} is SGD's; AdamW's momentum is optimizer.betas: "
            "set optimizer.name=sgd or optimizer.momentum=0"
        )


def _check_megatron(config: TrainConfig) -> None:
    """What rl-megatron does not do, refused rather than ignored."""
    if config.backend.name != "megatron":
        if config.backend.megatron:
            raise ValueError(
                f"backend.megatron sets megatron-core options, but backend.name="
                f"{config.backend.name}; set backend.name=megatron or remove backend.megatron"
            )
        return
    opt = config.optimizer
    if opt.name != "adamw":
        raise ValueError(
            f"backend.name=megatron trains with AdamW (optimizer.name={opt.name}): set "
            "optimizer.name=adamw, or backend.name=fsdp"
        )
    from rl_launcher.roles.backends import megatron_options  # imports torch: megatron only

    megatron_options(config)  # names checked against megatron-core's dataclasses
    _check_layer_split(config)


def _check_layer_split(config: TrainConfig) -> None:
    """megatron builds as many layers in each of the pipeline's model chunks (stages times
    virtual stages): the policy's layers must split evenly."""
    backend = config.backend
    virtual = backend.megatron.get("virtual_pipeline_model_parallel_size") or 1
    chunks = backend.pipeline_parallel * virtual
    if chunks == 1:
        return
    from rl_launcher.config.switch_checks import policy_hf_config

    layers = policy_hf_config(config).num_hidden_layers
    if layers % chunks:
        raise ValueError(
            f"backend.pipeline_parallel={backend.pipeline_parallel} x {virtual} virtual stages "
            f"(backend.megatron.virtual_pipeline_model_parallel_size) = {chunks} model chunks "
            f"do not split the policy's {layers} layers evenly (megatron builds as many in "
            f"each); pick sizes whose product divides {layers}"
        )


def _check_lora(config: TrainConfig) -> None:
    """LoRA adapters exist on rl-fsdp only, and need layers to go on."""
    model = config.model
    if not model.lora_rank:
        return
    if config.backend.name != "fsdp":
        raise ValueError(
            f"model.lora_rank={model.lora_rank} trains LoRA adapters on backend.name=fsdp only "
            f"(got {config.backend.name}); set backend.name=fsdp, or model.lora_rank=0 for full "
            "fine-tuning with megatron"
        )
    if not model.lora_targets:
        raise ValueError(
            "model.lora_targets is empty; name the Linear layers to adapt, e.g. "
            "[q_proj, k_proj, v_proj, o_proj]"
        )
    if model.lora_sync == "adapter" and config.rollout.source == "buffer":
        raise ValueError(
            "model.lora_sync=adapter serves the trained adapter only to requests that name "
            "it, and rollout.source=buffer's workers generate through the router without "
            "that name; set model.lora_sync=merged"
        )


def _check_rollout(config: TrainConfig) -> None:
    rollout = config.rollout
    if rollout.loop == "async" and rollout.max_staleness < 1:
        raise ValueError(
            "rollout.loop=async with rollout.max_staleness=0 is the synchronous loop; "
            "set rollout.loop=sync or rollout.max_staleness >= 1"
        )
    if rollout.replay_dir is not None and rollout.rollout_only:
        raise ValueError(
            "rollout.replay_dir (train only) and rollout.rollout_only exclude each other"
        )
    if rollout.source == "buffer":
        _check_buffer_source(config)
    if rollout.over_sampling > 1:
        _check_over_sampling(config)


def _check_rollout_function(config: TrainConfig) -> None:
    """rollout.rollout_function replaces the prompt rollout of the step-by-step loops."""
    rollout = config.rollout
    if rollout.rollout_function is None:
        return
    if rollout.loop == "async" or rollout.source != "prompts" or rollout.over_sampling > 1:
        raise ValueError(
            "rollout.rollout_function replaces the rollout of loop sync or one_step_async with "
            "rollout.source=prompts and no over_sampling; got loop="
            f"{rollout.loop}, source={rollout.source}, over_sampling={rollout.over_sampling:g}"
        )


def _check_group_reward(config: TrainConfig) -> None:
    if config.rollout.group_reward is not None and config.eval.datasets:
        raise ValueError(
            "rollout.group_reward scores training groups; evaluation scores one sample at a "
            "time with rollout.reward: leave eval.datasets empty, or score with rollout.reward"
        )


def _check_over_sampling(config: TrainConfig) -> None:
    """rollout.over_sampling refills the groups algorithm.group_filter drops inside one
    rollout of prompts: the continuous producer of loop=async, agent workers, replays and
    one-step-async's partial leftovers (two versions old) cannot honour it."""
    rollout = config.rollout
    if config.algorithm.group_filter == "keep_all":
        raise ValueError(
            "rollout.over_sampling > 1 refills groups algorithm.group_filter drops, and "
            "algorithm.group_filter=keep_all drops none: set a filter or over_sampling=1"
        )
    for name, value in (
        ("rollout.loop=async", rollout.loop == "async"),
        ("rollout.source=buffer", rollout.source == "buffer"),
        ("rollout.replay_dir", rollout.replay_dir),
        (f"mode={config.mode}", config.mode != "rl"),
        (
            "rollout.loop=one_step_async with rollout.partial_rollout",
            rollout.loop == "one_step_async" and rollout.partial_rollout,
        ),
    ):
        if value:
            raise ValueError(
                f"rollout.over_sampling > 1 refills filtered groups in a rollout of prompts, "
                f"which {name} does not run; set rollout.over_sampling=1 (the buffer still "
                "filters) or unset it"
            )


def _check_buffer_source(config: TrainConfig) -> None:
    """rollout.source=buffer: the workers' groups arrive whole and scored, one batch a step."""
    rollout = config.rollout
    for name, value in (
        ("rollout.loop=async", rollout.loop == "async"),
        ("rollout.replay_dir", rollout.replay_dir),
        ("rollout.rollout_only", rollout.rollout_only),
        (f"mode={config.mode}", config.mode != "rl"),
    ):
        if value:
            raise ValueError(
                f"rollout.source=buffer trains on the groups agent workers write, so {name} "
                "does not apply; unset it (or use rollout.source=prompts)"
            )


def _check_sampling(config: TrainConfig) -> None:
    """The engines' rules (SGLang's and the embedded engine's) for what they are sent."""
    top_k = config.rollout.top_k
    if top_k == 0:
        raise ValueError(
            "rollout.top_k=0 is not a way to turn top-k off here (Hugging Face reads it so); "
            "the engines refuse it: write -1 for off, or a k >= 1"
        )
    if top_k < -1:
        raise ValueError(f"rollout.top_k must be -1 (off) or a k >= 1, got {top_k}")


def _check_devices(config: TrainConfig) -> None:
    if config.engine.kind == "sglang" and config.cluster.device != "cuda":
        raise ValueError(
            "engine.kind=sglang needs cluster.device=cuda; on CPU use engine.kind=embedded"
        )
    if config.cluster.device == "cpu" and config.cluster.cpus_per_bundle <= 0:
        raise ValueError(
            "cluster.cpus_per_bundle must be > 0 on cluster.device=cpu (the CPU is the device)"
        )
    _check_engines_over_nodes(config)
    backend = config.backend
    model_parallel = backend.tensor_parallel * backend.pipeline_parallel * backend.context_parallel
    num_ranks = plan_from_config(config).num_train_ranks
    if num_ranks % model_parallel:
        raise ValueError(
            f"backend.num_ranks={num_ranks} is not a multiple of tensor_parallel x "
            f"pipeline_parallel x context_parallel = {model_parallel}"
        )


def _check_engines_over_nodes(config: TrainConfig) -> None:
    """An engine with more devices than a node (engine.devices_per_engine >
    cluster.devices_per_node) spans whole nodes: only SGLang does that (--nnodes), and
    tensor handles do not cross nodes."""
    engine, per_node = config.engine, config.cluster.devices_per_node
    if engine.devices_per_engine <= per_node:
        return
    where = f"engine.devices_per_engine={engine.devices_per_engine} > cluster.devices_per_node={per_node}"
    if engine.kind != "sglang":
        raise ValueError(
            f"{where} makes each engine span several nodes, which the embedded engine cannot "
            "(it runs on one device); use engine.kind=sglang (--nnodes) or make "
            "engine.devices_per_engine at most cluster.devices_per_node"
        )
    transport = resolve_transport(
        engine.weight_sync, colocate=config.cluster.colocate, device=config.cluster.device
    )
    if transport == "tensor":
        raise ValueError(
            f"{where} makes each engine span several nodes, and engine.weight_sync=tensor "
            "(what auto picks colocated) hands tensor handles within one node; set "
            "engine.weight_sync to distributed or disk"
        )


def _check_data(config: TrainConfig) -> None:
    if not config.data.train and config.rollout.replay_dir is None:
        raise ValueError("data.train is empty; give at least one dataset (path: file.jsonl)")
    if config.data.train and sum(d.weight for d in config.data.train) <= 0:
        raise ValueError("data.train weights sum to 0; give at least one dataset a positive weight")


def _check_eval(config: TrainConfig) -> None:
    evaluation = config.eval
    for k in evaluation.pass_k:
        if not 1 <= k <= evaluation.samples_per_prompt:
            raise ValueError(
                f"eval.pass_k contains {k}; every k must be in 1..eval.samples_per_prompt "
                f"({evaluation.samples_per_prompt})"
            )
    if evaluation.interval and not evaluation.datasets:
        raise ValueError("eval.interval is set but eval.datasets is empty; add a dataset or set 0")


def _check_modes(config: TrainConfig) -> None:
    """SFT, DPO, replay and rollout-only runs lack a part that some options need."""
    rollout = config.rollout
    if config.mode == "dpo":
        _check_dpo(config)
    if config.mode in ("sft", "dpo"):
        for name, value in (
            ("rollout.dump_dir", rollout.dump_dir),
            ("rollout.replay_dir", rollout.replay_dir),
            ("rollout.rollout_only", rollout.rollout_only),
            ("eval.interval", config.mode == "sft" and config.eval.interval),
        ):
            if value:
                raise ValueError(
                    f"mode={config.mode} starts no engines, so {name} does not apply; unset it "
                    "(evaluate its checkpoint with rl-eval, or in the RL run that starts from it)"
                )
    if rollout.replay_dir and config.eval.interval:
        raise ValueError(
            "rollout.replay_dir trains without engines, so eval.interval cannot run; set it to 0"
        )


def _check_dpo(config: TrainConfig) -> None:
    """DPO is wired for rl-fsdp, one optimizer step per batch of pairs."""
    if config.backend.name != "fsdp":
        raise ValueError(
            f"mode=dpo runs on backend.name=fsdp only (got {config.backend.name}): the "
            "Megatron backend does not keep a pair's two sequences in one micro-batch yet; "
            "set backend.name=fsdp"
        )
    if config.algorithm.num_minibatches != 1:
        raise ValueError(
            "mode=dpo takes one optimizer step per batch of pairs: set "
            "algorithm.num_minibatches=1 (and a smaller rollout.batch_size for more steps)"
        )


def _check_distill(config: TrainConfig) -> None:
    """On-policy distillation needs exactly one teacher and a loop whose student samples."""
    distill = config.distill
    teachers = [name for name in ("teacher_url", "teacher_path") if getattr(distill, name)]
    if distill.coef == 0:
        if teachers:
            raise ValueError(
                f"distill.{teachers[0]} is set but distill.coef=0, so the teacher would not "
                "be asked; set distill.coef > 0 (e.g. 1.0), or unset the teacher"
            )
        return
    if len(teachers) != 1:
        raise ValueError(
            f"distill.coef={distill.coef} needs one teacher: set distill.teacher_url (a running "
            "engine) or distill.teacher_path (an HF directory), not "
            + ("both" if teachers else "neither")
        )
    if config.mode != "rl" or config.rollout.rollout_only:
        raise ValueError(
            "distill.coef > 0 shapes the advantages of RL training; mode=rl without "
            "rollout.rollout_only needs it, so set distill.coef=0 here"
        )
    if distill.teacher_path and config.cluster.device != "cpu":
        raise ValueError(
            "distill.teacher_path runs the teacher on the driver's CPU; on cluster.device=cuda "
            "start an SGLang server on the teacher and give its address as distill.teacher_url"
        )


def check_loop(config) -> None:
    """Loop settings that only make sense together (ValueError with the fix); the RL loop
    checks them first (:func:`rl_launcher.loops.rl.train`)."""
    rollout, algorithm = config.rollout, config.algorithm
    importance = rollout.loop != "sync" and rollout.stale_policy == "importance"
    if algorithm.old_log_probs == "train_step" and (
        algorithm.num_minibatches > 1 or algorithm.reward_kl_coef > 0
    ):
        raise ValueError(
            "algorithm.old_log_probs=train_step takes the old log-probs from the one update's "
            "own forward: it needs algorithm.num_minibatches=1 and reward_kl_coef=0 (several "
            "updates, or a KL-shaped reward, need them before training: use recompute)"
        )
    if importance and not algorithm.rollout_is_level:
        raise ValueError(
            "rollout.stale_policy=importance corrects stale samples with rollout importance "
            "weights: set algorithm.rollout_is_level=token (or sequence)"
        )
