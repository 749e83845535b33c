"""Checks of slime's algorithm switches (issue 31), before anything starts: each raises
ValueError naming the fields involved and the way out. Called by
:func:`rl_launcher.config.checks.check_consistency`."""

from pathlib import Path

from rl_launcher.config import TrainConfig


def check_switches(config: TrainConfig) -> None:
    for check in (_check_old_log_probs, _check_reference, _check_critic, _check_debug):
        check(config)
    check_freezing(config)


def _check_old_log_probs(config: TrainConfig) -> None:
    algorithm = config.algorithm
    if algorithm.old_log_probs == "rollout" and algorithm.rollout_is_level is not None:
        raise ValueError(
            "algorithm.old_log_probs=rollout makes the rollout policy pi_old, so the rollout "
            "importance weights pi_old / pi_rollout would all be 1: unset "
            "algorithm.rollout_is_level (and keep rollout.stale_policy=drop: the PPO ratio to "
            "the rollout policy already covers stale samples), or use "
            "algorithm.old_log_probs=recompute"
        )
    if algorithm.opsm and algorithm.old_log_probs == "train_step":
        raise ValueError(
            "algorithm.opsm measures how far the policy moved from pi_old, and with "
            "algorithm.old_log_probs=train_step pi_old is the policy itself (nothing is ever "
            "masked): use old_log_probs=recompute or rollout, or opsm=false"
        )
    if algorithm.unbiased_kl and algorithm.kl_coef == 0:
        raise ValueError(
            "algorithm.unbiased_kl weights the loss's KL term, which is off "
            "(algorithm.kl_coef=0): set kl_coef > 0 or unbiased_kl=false"
        )


def _check_reference(config: TrainConfig) -> None:
    algorithm, lora = config.algorithm, config.model.lora_rank
    kl_on = algorithm.kl_coef > 0 or algorithm.reward_kl_coef > 0 or config.mode == "dpo"
    settings = {
        "ref_path": algorithm.ref_path,
        "ref_update_interval": algorithm.ref_update_interval or None,  # 0: never
    }
    for field, value in settings.items():
        if value is None:
            continue
        if not kl_on:
            raise ValueError(
                f"algorithm.{field}={value!r} sets up the KL reference, and no KL is on: set "
                f"algorithm.kl_coef or reward_kl_coef > 0, or unset algorithm.{field}"
            )
        if lora:
            raise ValueError(
                f"algorithm.{field}: with model.lora_rank > 0 the reference is the base "
                f"model with the adapters off; unset algorithm.{field} or train without LoRA"
            )
    path = algorithm.ref_path
    if path is not None and not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"algorithm.ref_path={path!r} is not a Hugging Face model directory (no "
            "config.json); give one with the policy's architecture and tokenizer, or null "
            "for the policy's initial weights"
        )


def _check_critic(config: TrainConfig) -> None:
    algorithm = config.algorithm
    if algorithm.critic_warmup_steps and algorithm.advantage_estimator != "gae":
        raise ValueError(
            f"algorithm.critic_warmup_steps={algorithm.critic_warmup_steps} warms up PPO's "
            f"critic, and advantage_estimator={algorithm.advantage_estimator} has none: set "
            "advantage_estimator=gae or critic_warmup_steps=0"
        )


def _check_debug(config: TrainConfig) -> None:
    if config.logging.dump_train_batch and (config.mode != "rl" or config.rollout.rollout_only):
        raise ValueError(
            "logging.dump_train_batch writes the RL loop's train batches; with mode="
            f"{config.mode} or rollout.rollout_only there are none: set it false"
        )
    if config.rollout.replay_fraction < 1 and config.rollout.replay_dir is None:
        raise ValueError(
            f"rollout.replay_fraction={config.rollout.replay_fraction} subsamples replayed "
            "rollouts; set rollout.replay_dir (dumps of rollout.dump_dir) or replay_fraction=1"
        )


def check_freezing(config: TrainConfig) -> None:
    """model.train_only / model.freeze: valid regular expressions, each matching some
    parameter of the model (names as Hugging Face writes them), not with LoRA."""
    from rl_core.freezing import check_patterns

    model = config.model
    if not model.train_only and not model.freeze:
        return
    if model.lora_rank:
        raise ValueError(
            "model.train_only / model.freeze pick full parameters to train, and LoRA "
            "(model.lora_rank > 0) trains only its adapters: use one or the other"
        )
    names = hf_parameter_names(config)
    check_patterns(names, train_only=model.train_only, freeze=model.freeze)


def hf_parameter_names(config: TrainConfig) -> list[str]:
    """The policy's parameter names as the backends see them, from a skeleton on the meta
    device (no weights read). For a .gguf file the skeleton's config comes from the GGUF
    header (:func:`gguf_config`): the loader (:func:`rl_launcher.session.model.load_gguf`)
    maps the GGUF's tensors onto exactly this skeleton's parameters and refuses a file that
    leaves one out, so these are the names of the HF model it converts to."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(policy_hf_config(config))
    return [name for name, _ in model.named_parameters()]


def policy_hf_config(config: TrainConfig):
    """The policy's HF config: ``model.init_config``, the directory's config.json or a
    .gguf header (:func:`gguf_config`); no weights read."""
    from transformers import AutoConfig

    path = config.model.path
    if path is None:
        return AutoConfig.for_model(**config.model.init_config)
    if str(path).endswith(".gguf"):
        return gguf_config(Path(path))
    return AutoConfig.from_pretrained(path)


def gguf_config(path: Path):
    """The HF config of a .gguf file, from its header's metadata (gguf's reader maps the
    file and parses the header; no tensor is read or dequantized), as the loader builds it."""
    from transformers import AutoConfig

    if not path.is_file():
        raise ValueError(f"model.path={str(path)!r} does not exist; give a .gguf file")
    try:
        import gguf  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "model.path is a .gguf file: pip install gguf (or uv sync --extra gguf)"
        ) from error
    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
