"""The typed configuration tree of a run: one keyword-only dataclass per section.

Every field carries its meaning in ``metadata["help"]`` (docs/config.md is generated from
it), and optionally ``choices`` (a tuple or an rl_core registry) and ``low`` (smallest
allowed number). The defaults run the CPU quickstart: a tiny model built from a config,
one embedded engine, the FSDP backend over gloo and GRPO, colocated on one CPU bundle.
Loading, overrides and validation live in :mod:`rl_launcher.config.loader`.
"""

from dataclasses import MISSING, dataclass, field
from typing import Any

from rl_core.filters import GROUP_FILTERS
from rl_core.names import (  # torch-free: a config is checked without importing torch
    ADVANTAGE_ESTIMATORS,
    AGGREGATION_MODES,
    IS_LEVELS,
    IS_MODES,
    KL_KINDS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    load_reducer,
)

# bound -> (how a message says it, how docs/config.md says it)
BOUNDS = {
    "low": (">=", "At least"),
    "above": (">", "Above"),
    "high": ("<=", "At most"),
    "below": ("<", "Below"),
}


def meta(help: str, *, choices=None, dotted=None, **bounds) -> dict[str, Any]:
    """Field metadata: its documentation and validation rules.

    ``bounds`` may hold ``low`` (value >= low), ``above`` (> above), ``high`` (<= high)
    and ``below`` (< below); a float must also be finite. ``dotted``: a function that loads
    and checks a dotted path ``pkg.module:function`` given instead of one of ``choices``
    (an rl_core registry with a call shape takes them without it).
    """
    unknown = set(bounds) - set(BOUNDS)
    assert not unknown, f"unknown bounds {unknown}; use {list(BOUNDS)}"
    rules = {name: bounds.get(name) for name in BOUNDS}
    return {"help": help, "choices": choices, "dotted": dotted, **rules}


def option(default: Any = MISSING, *, help: str, choices=None, dotted=None, **bounds) -> Any:
    """A field with an immutable default (or none: required) and its metadata."""
    return field(default=default, metadata=meta(help, choices=choices, dotted=dotted, **bounds))


DOTTED = " Or a dotted path pkg.module:function of the built-ins' signature (docs/extending.md)."

# model.lora_targets by default: every attention and MLP projection of Llama-like decoders
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(kw_only=True)
class ClusterConfig:
    """Where the run executes: Ray cluster and device pool."""

    ray_address: str | None = option(
        None,
        help="Ray cluster to attach to (host:port of its head, or ray://host:10001); null "
        "reads RAY_ADDRESS (set by `ray job submit`), else starts a local Ray.",
    )
    device: str = option("cpu", help="Device kind of every bundle.", choices=("cpu", "cuda"))
    num_nodes: int = option(
        1,
        help="Nodes the run is placed on, each a distinct Ray node with room for "
        "devices_per_node bundles (larger nodes are fine; too few is an error before anything "
        "starts).",
        low=1,
    )
    devices_per_node: int = option(
        1, help="GPUs per node (cuda) or CPU bundles per node (cpu).", low=1
    )
    cpus_per_bundle: float = option(
        1.0, help="CPUs reserved with each bundle (more than 0 on cluster.device=cpu).", low=0
    )
    colocate: bool = option(
        True,
        help="Training and engines share the devices and take turns; false gives each its own pool.",
    )
    connect_timeout_s: float = option(
        30.0,
        help="Seconds to wait for the Ray cluster of ray_address (or RAY_ADDRESS) to answer on "
        "its port before rl-train gives up, naming the address.",
        above=0,
    )


@dataclass(kw_only=True)
class ModelConfig:
    """The policy model and its tokenizer."""

    path: str | None = option(
        None,
        help="Hugging Face model directory, or a .gguf file (dequantized once into the run "
        "directory; needs the gguf package); null builds a tiny model from init_config.",
    )
    tokenizer_path: str | None = option(
        None, help="Tokenizer directory; null uses model.path (or the example's tokenizer)."
    )
    init_config: dict[str, Any] = field(
        metadata=meta("Model config used when path is null (a transformers config as a mapping)."),
        default_factory=lambda: {
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 512,
            "max_position_embeddings": 512,
        },
    )
    dtype: str = option(
        "float32",
        help="Parameter dtype (float16 is not offered: it needs loss scaling, which no "
        "backend does; use bfloat16).",
        choices=("float32", "bfloat16"),
    )
    gradient_checkpointing: bool = option(
        False,
        help="Recompute activations in backward (Megatron: full recompute of every layer, "
        "unless backend.megatron sets recompute_granularity).",
    )
    lora_rank: int = option(
        0,
        help="Rank of LoRA adapters on model.lora_targets (0: full fine-tuning). Only the "
        "adapters train, and the optimizer and checkpoints hold only them (with the base's "
        "path); a KL reference is the base with the adapters off; engines get the adapters "
        "or merged weights (model.lora_sync). RL and SFT, backend.name=fsdp (the critic "
        "trains in full).",
        low=0,
    )
    lora_alpha: float = option(
        16.0, help="LoRA scale: adapters add lora_alpha / lora_rank * B A x.", above=0
    )
    lora_dropout: float = option(
        0.0, help="Dropout on the adapters' input while training.", low=0, below=1
    )
    lora_targets: list[str] = field(
        default_factory=lambda: list(LORA_TARGETS),
        metadata=meta(
            "Linear layers that get adapters, by the last part of their name (Qwen, Llama, "
            "Mistral, Gemma: the attention and MLP projections)."
        ),
    )
    lora_sync: str = option(
        "adapter",
        help="How LoRA reaches the engines each sync. adapter: the adapters alone, as a PEFT "
        "directory under the weight-sync dir (engine.weight_sync_dir, else "
        "<run_dir>/sync_weights; on several nodes storage every engine reads), loaded by name "
        "per version (SGLang's /load_lora_adapter; engines start with --enable-lora, "
        "--max-lora-rank and --lora-target-modules) and named by every request; the embedded "
        "engine then decodes with its dynamic runner. merged: the base with the adapters "
        "merged in, through engine.weight_sync (every base weight, each sync).",
        choices=("adapter", "merged"),
    )
    train_only: list[str] = field(
        default_factory=list,
        metadata=meta(
            "Train only the parameters whose Hugging Face name matches one of these Python "
            "regular expressions (re.search, as slime's --only-train-params-name-list), "
            "e.g. ['mlp', 'layers\\.1\\.']; the rest are frozen and the optimizer holds only "
            "the trained ones. Empty = all. A pattern that matches no parameter is refused "
            "before anything starts (a .gguf model's names are read from the file's header). "
            "Both backends; a fused Megatron parameter (q/k/v, "
            "gate/up) trains when all its sources match, and patterns that split one are "
            "refused."
        ),
    )
    freeze: list[str] = field(
        default_factory=list,
        metadata=meta(
            "Freeze the parameters whose Hugging Face name matches one of these Python "
            "regular expressions (re.search, as slime's --freeze-params-name-list), after "
            "train_only; e.g. ['embed_tokens', 'lm_head']. A pattern matching nothing is refused."
        ),
    )


@dataclass(kw_only=True)
class BackendConfig:
    """The training backend and its parallel layout."""

    name: str = option("fsdp", help="Training backend.", choices=("fsdp", "megatron"))
    num_ranks: int | None = option(
        None,
        help="Training ranks; null = every device when colocated, the devices engines leave otherwise.",
        low=1,
    )
    micro_batch_tokens: int = option(4096, help="Token budget of one micro-batch.", low=1)
    offload_when_idle: bool = option(
        True,
        help="Colocated on GPUs: move training state to host memory while engines generate "
        "(false: it stays on the device when both fit).",
    )
    tensor_parallel: int = option(1, help="Megatron tensor-parallel size.", low=1)
    pipeline_parallel: int = option(1, help="Megatron pipeline-parallel size.", low=1)
    context_parallel: int = option(1, help="Context-parallel size.", low=1)
    expert_parallel: int = option(1, help="Megatron expert-parallel size.", low=1)
    extra_args: list[str] = field(
        default_factory=list,
        metadata=meta(
            "Backend-specific options passed through verbatim (--megatron-* on the command line)."
        ),
    )
    megatron: dict[str, Any] = field(
        default_factory=dict,
        metadata=meta(
            "megatron-core options by field name, e.g. {recompute_granularity: selective} or "
            "{recompute_granularity: full, recompute_method: uniform, recompute_num_layers: 1}: "
            "any TransformerConfig field goes into the model's config as given, and "
            "use_distributed_optimizer (ZeRO-1 over data-parallel ranks; default true) from "
            "the DDP / optimizer configs. Names are checked at load against megatron-core's "
            "dataclasses; the fields set by other options (parallel sizes, model.dtype, the "
            "model's shape, optimizer.*) are refused naming that option."
        ),
    )


@dataclass(kw_only=True)
class OptimizerConfig:
    """Optimizer and learning-rate schedule (the critic reuses them unless told)."""

    name: str = option(
        "adamw",
        help="Optimizer. sgd (rl-fsdp only): w - lr x (grad + weight_decay x w), with "
        "momentum when set.",
        choices=("adamw", "sgd"),
    )
    momentum: float = option(0.0, help="SGD momentum; 0 = plain SGD.", low=0, below=1)
    lr: float = option(1e-4, help="Peak learning rate.", above=0)
    critic_lr: float | None = option(None, help="Critic learning rate; null = lr.", above=0)
    betas: list[float] = field(
        default_factory=lambda: [0.9, 0.999], metadata=meta("Adam betas: two numbers in [0, 1).")
    )
    eps: float = option(1e-8, help="Adam epsilon.", above=0)
    weight_decay: float = option(0.0, help="Decoupled weight decay.", low=0)
    grad_clip: float = option(1.0, help="Clip the global gradient norm to this; 0 disables.", low=0)
    schedule: str = option(
        "constant", help="Learning-rate schedule.", choices=("constant", "linear", "cosine")
    )
    warmup_steps: int = option(
        0,
        help="Linear warm-up, in rl-train steps (each of algorithm.num_minibatches updates).",
        low=0,
    )
    min_lr_ratio: float = option(
        0.0,
        help="Final lr / peak lr for linear and cosine, reached at num_steps (the decay "
        "counts rl-train steps, not optimizer updates).",
        low=0,
        high=1,
    )


@dataclass(kw_only=True)
class AlgorithmConfig:
    """What is optimised: advantages, policy loss, KL, entropy, filtering."""

    advantage_estimator: str = option(
        "grpo",
        help="Advantage estimator (gae trains a critic)." + DOTTED,
        choices=ADVANTAGE_ESTIMATORS,
    )
    policy_loss: str = option(
        "ppo",
        help="Policy loss; a dotted path reaches both backends (through rl_core's Objective)."
        + DOTTED,
        choices=POLICY_LOSSES,
    )
    loss_agg_mode: str = option(
        "token-mean",
        help="How per-token losses become one number." + DOTTED,
        choices=AGGREGATION_MODES,
        dotted=load_reducer,
    )
    clip_low: float = option(0.2, help="Lower ratio clip (1 - clip_low).", low=0)
    clip_high: float | None = option(
        None, help="Upper ratio clip (1 + clip_high); null = clip_low.", low=0
    )
    dual_clip: float | None = option(
        None, help="Dual-clip bound c for negative advantages; null disables it.", above=1
    )
    kl_coef: float = option(
        0.0,
        help="KL-to-reference loss weight. The reference model is loaded only when this or "
        "reward_kl_coef is > 0.",
        low=0,
    )
    kl_kind: str = option("low_var_kl", help="KL estimator of the loss.", choices=KL_KINDS)
    unbiased_kl: bool = option(
        False,
        help="Weight the loss's KL term by the ratio pi / pi_old (its gradient kept), which "
        "makes the estimate unbiased for tokens sampled by the old policy (DeepSeek-V3.2; "
        "slime's --use-unbiased-kl). Needs kl_coef > 0.",
    )
    ref_path: str | None = option(
        None,
        help="Hugging Face directory of a separate KL reference (slime's --ref-load; same "
        "architecture and tokenizer as the policy); null = the policy's initial weights.",
    )
    ref_update_interval: int = option(
        0,
        help="Copy the policy's weights into the KL reference after every N-th step "
        "(slime's --ref-update-interval); 0 = the reference never changes. Needs kl_coef or "
        "reward_kl_coef > 0. A refreshed reference is saved in checkpoints, so --resume "
        "continues with the uninterrupted run's reference at any step.",
        low=0,
    )
    reward_kl_coef: float = option(
        0.0,
        help="KL-to-reference penalty in the reward: each response token's reward loses this "
        "times the KL of the step's old policy to the reference before the advantages "
        "(reinforce_plus_plus, reinforce_plus_plus_baseline, gae; grpo, dr_grpo and rloo "
        "ignore it and refuse it). Independent of the loss's kl_coef. verl's "
        "use_kl_in_reward with kl_ctrl.kl_coef (apply_kl_penalty); slime's --kl-coef.",
        low=0,
    )
    reward_kl_kind: str = option(
        "k1",
        help="KL estimator of the reward penalty; k1 = old - reference log-prob, whose sum "
        "over a response estimates the sequence KL.",
        choices=KL_KINDS,
    )
    entropy_coef: float = option(0.0, help="Entropy bonus weight.", low=0)
    dpo_loss: str = option(
        "sigmoid",
        help="mode=dpo: preference loss; sigmoid (DPO, with dpo_label_smoothing) or ipo.",
        choices=PREFERENCE_LOSSES,
    )
    dpo_beta: float = option(
        0.1,
        help="mode=dpo: beta, the strength of the implicit KL constraint to the frozen "
        "reference (the starting model); the implicit reward is beta x (policy - reference) "
        "sequence log-prob.",
        above=0,
    )
    dpo_label_smoothing: float = option(
        0.0,
        help="mode=dpo, sigmoid loss: the assumed share of flipped preference labels "
        "(conservative DPO).",
        low=0,
        below=0.5,
    )
    normalize_advantages: bool | None = option(
        None,
        help="Whiten the advantages over the step's response tokens (mean 0, std 1; slime's "
        "--normalize-advantages). null = each estimator's own choice (reinforce_plus_plus, "
        "reinforce_plus_plus_baseline and gae whiten; grpo, dr_grpo and rloo do not); true "
        "= every estimator; false = none.",
    )
    critic_warmup_steps: int = option(
        0,
        help="gae: the first N steps train only the critic; the policy's weights (and the "
        "engines') stay as they are (slime's --num-critic-only-steps).",
        low=0,
    )
    value_clip: float | None = option(
        0.2,
        help="gae: the critic's new values are clipped to old value +- value_clip in its "
        "loss (PPO value clipping, slime's --value-clip); null = no clipping.",
        above=0,
    )
    gamma: float = option(1.0, help="Discount (gae, reinforce_plus_plus).", low=0, high=1)
    lam: float = option(1.0, help="GAE lambda.", low=0, high=1)
    group_filter: str = option(
        "keep_all",
        help="Dynamic-sampling filter applied per prompt group." + DOTTED,
        choices=GROUP_FILTERS,
    )
    reward_key: str | None = option(
        None, help="Key of the scalar reward when a reward function returns a mapping."
    )
    num_minibatches: int = option(1, help="Optimizer steps per rollout batch.", low=1)
    old_log_probs: str = option(
        "recompute",
        help="Where the PPO ratio's old log-probs come from. recompute: a forward pass of "
        "the whole batch before training (as slime and verl do). train_step: the train "
        "step's own forward, detached (ratio 1, as TRL with num_iterations 1), saving that "
        "pass; needs num_minibatches 1 and reward_kl_coef 0. rollout: the engine's sampled "
        "log-probs, no trainer pass (slime's --use-rollout-logprobs); refused with "
        "rollout_is_level, whose weights would all be 1. With train_step and rollout the "
        "engine-vs-trainer gap is reported as its mean only, from the first minibatch's "
        "forward.",
        choices=("recompute", "train_step", "rollout"),
    )
    opsm: bool = option(
        False,
        help="Off-policy sequence masking (DeepSeek-V3.2; slime's --use-opsm): a sequence "
        "whose mean (old - current) log-prob over its tokens exceeds opsm_delta and whose "
        "advantage is negative leaves the policy loss (metric pg/opsm_frac: the share of "
        "response tokens dropped).",
    )
    opsm_delta: float = option(
        1e-4, help="OPSM's bound on a sequence's drift (slime's --opsm-delta).", low=0
    )
    max_logprob_gap: float | None = option(
        None,
        help="Stop the run (exit 1) after a step whose mean |trainer - engine| log-prob gap "
        "(mismatch/logprob_abs_diff_mean) exceeds this: a correctness gate for weight sync "
        "and kernels (slime's --ci-train-rollout-logprob-abs-diff-threshold); null = no gate.",
        above=0,
    )
    rollout_is_level: str | None = option(
        None,
        help="Rollout importance correction level; null disables it.",
        choices=IS_LEVELS,
    )
    rollout_is_mode: str = option(
        "truncate", help="Rollout importance correction.", choices=IS_MODES
    )
    rollout_is_cap: float = option(2.0, help="Upper bound of the importance weight.", above=0)
    routing_replay: bool = option(
        False,
        help="Rollout routing replay (R3; slime's --use-rollout-routing-replay) for MoE "
        "models: every rollout request asks for the experts the engine chose for each token "
        "(SGLang's return_routed_experts; engines start with --enable-return-routed-experts), "
        "the samples carry them, and the policy's routers use them in the old-log-prob and "
        "training passes (both backends; the given experts' weights come from the router's "
        "own scores: softmax, or DeepSeek-V3's sigmoid renormalised and scaled, so the router "
        "still trains); the KL reference routes on its own. Hugging Face families "
        "qwen3_moe, qwen2_moe, olmoe, mixtral, deepseek_v3. With engine.kind=sglang the "
        "requests that ask for experts go from the rollout straight to the router's "
        "healthy workers (sglang-router 0.3.2 drops return_routed_experts from what it "
        "forwards); the rest still go through the router. Refused on a dense model, with "
        "rollout.source=buffer or rollout.data_plane=workers, and with megatron pipeline "
        "parallelism plus activation recompute.",
    )
    max_nonfinite_steps: int = option(
        3,
        help="Stop the run after this many steps in a row whose loss or gradients were NaN "
        "or inf (each such update is skipped); 0 never stops.",
        low=0,
    )
    max_empty_steps: int = option(
        3,
        help="Stop the run (exit 1, naming the cause) after this many steps in a row that "
        "trained no sample because samples failed: refused by the engine or their reward "
        "failed (rollout.on_reward_error=skip); steps whose groups were only filtered "
        "(algorithm.group_filter) are reported but not counted; 0 never stops. A run that "
        "trains no sample at all fails at its end either way.",
        low=0,
    )


@dataclass(kw_only=True)
class DistillConfig:
    """On-policy distillation (slime's --use-opd): a teacher scores the student's samples."""

    coef: float = option(
        0.0,
        help="On-policy distillation weight: every response token's advantage loses coef "
        "times (student - teacher) log-prob of that token, the student's being the engine's "
        "rollout log-prob (rl_core.distill.opd_advantages; metric opd/reverse_kl). Added to "
        "the estimator's advantage before any whitening (normalize_advantages, or the "
        "estimator's default), as slime does; for distillation alone give every sample the "
        "same reward (e.g. a mapping whose algorithm.reward_key is a constant). 0 = off; > 0 "
        "needs teacher_url or teacher_path.",
        low=0,
    )
    teacher_url: str | None = option(
        None,
        help="A running teacher engine (SGLang server, embedded engine or a router in front "
        "of them; same tokenizer as the student) that scores each sample with /generate, "
        "max_new_tokens 0 and prompt log-probs. Exclusive with teacher_path.",
    )
    teacher_path: str | None = option(
        None,
        help="An HF model directory (same tokenizer as the student): rl-train starts an "
        "embedded engine on it as the teacher, a child of the driver on the driver's CPU "
        "(model.dtype; its log in <run_dir>/teacher_logs). Exclusive with teacher_url; "
        "cluster.device=cpu only: on GPUs start an SGLang teacher and give its teacher_url.",
    )


@dataclass(kw_only=True)
class RolloutConfig:
    """How samples are produced and how generation overlaps training."""

    batch_size: int = option(
        8, help="Prompts per training step (mode=sft: examples per step).", low=1
    )
    group_size: int = option(
        4,
        help="Samples per prompt; the group-relative advantage estimators (grpo, dr_grpo, "
        "rloo, reinforce_plus_plus_baseline) need at least 2.",
        low=1,
    )
    max_response_tokens: int = option(32, help="Response length limit.", low=1)
    temperature: float = option(1.0, help="Sampling temperature; 0 = greedy.", low=0)
    top_p: float = option(1.0, help="Nucleus sampling mass; 1 disables.", above=0, high=1)
    top_k: int = option(
        -1,
        help="Top-k sampling: keep the k >= 1 most likely tokens; -1 = off. 0 is refused "
        "rather than read as off (Hugging Face's meaning), as SGLang refuses it: write -1.",
    )
    stop: list[str] = field(default_factory=list, metadata=meta("Stop strings."))
    function: str = option(
        "default",
        help="Per-sample generate function: default, or a dotted path pkg.module:function "
        "called as async fn(ctx, sample, sampling_params); it may return a list of samples, "
        "which all join the prompt's group (docs/extending.md).",
    )
    reward: str = option(
        "math",
        help="Reward function: a name in rl-rewards or a dotted path pkg.module:function, "
        "fn(response, label, **reward_options), or fn(sample, **reward_options) when its "
        "first parameter is named sample (the whole rl_core.Sample; the data row's other "
        "columns in sample.metadata); async def rewards are awaited; returns a float or a "
        "mapping (algorithm.reward_key picks).",
    )
    reward_options: dict[str, Any] = field(
        default_factory=dict,
        metadata=meta(
            "Keyword options of the reward (e.g. the remote reward's url, token, timeout_s); "
            "names it does not take are refused at load, listing those it does."
        ),
    )
    group_reward: str | None = option(
        None,
        help="Dotted path of a reward of a whole group, [async] fn(samples: list[Sample]) -> "
        "list[float], called once every sample of the prompt has finished; replaces "
        "rollout.reward (reward_timeout_s and on_reward_error apply to the call).",
    )
    sample_filter: str | None = option(
        None,
        help="Dotted path of fn(sample) -> bool, asked of every scored sample before its "
        "reward is used; False leaves the sample out of training (a group left empty is "
        "dropped). Metric rollout/samples_filtered.",
    )
    post_process: str | None = option(
        None,
        help="Dotted path of fn(groups: list[list[Sample]]) -> list[list[Sample]] | None: every "
        "group of a step, after sample_filter and before the advantages (change them in "
        "place and return None, or return the groups to train on).",
    )
    rollout_function: str | None = option(
        None,
        help="Dotted path of async fn(ctx: RolloutContext) -> list[list[Sample]] that replaces "
        "the whole rollout of a step (the engines' client, the prompts, the step, the sampling "
        "parameters, the tokenizer and the reward in ctx; docs/extending.md). Loop sync or "
        "one_step_async, rollout.source=prompts.",
    )
    loop: str = option("sync", help="Training loop.", choices=("sync", "one_step_async", "async"))
    max_staleness: int = option(
        1, help="Async loop: samples older than this many weight versions are stale.", low=0
    )
    stale_policy: str = option(
        "drop", help="What happens to stale samples.", choices=("drop", "importance")
    )
    partial_rollout: bool = option(
        False, help="Resume aborted generations after a weight update instead of restarting."
    )
    over_sampling: float = option(
        1.0,
        help="DAPO refill (needs algorithm.group_filter; loop sync, or one_step_async without "
        "partial_rollout): a step launches up to ceil(over_sampling x batch_size) prompts, "
        "drawn one launch at a time, until batch_size groups pass the filter; groups still "
        "running are aborted and resumed first next step (partial responses kept with "
        "partial_rollout). 1: no refill, the buffer filters and a step may train fewer groups.",
        low=1,
    )
    dump_dir: str | None = option(None, help="Write every rollout's samples here.")
    replay_dir: str | None = option(None, help="Train only, replaying rollouts dumped earlier.")
    replay_fraction: float = option(
        1.0,
        help="replay_dir: train each replayed rollout on this fraction of its groups (at "
        "least one), drawn with the run's seed (slime's --load-debug-rollout-data-subsample).",
        above=0,
        high=1,
    )
    source: str = option(
        "prompts",
        help="Where a step's groups come from: prompts (engines generate from data.train) or "
        "buffer: agent workers anywhere POST scored trajectories to a rollout buffer rl-train "
        "serves (URL printed and written to <run_dir>/rollout_buffer_url.json with the "
        "router's; see rl_sglang.agent.buffer), kept in <run_dir>/rollout_buffer.json until "
        "a checkpoint holds their training, so --resume loses none. Engines, weight sync and "
        "checkpoints run as usual: the workers generate through the router.",
        choices=("prompts", "buffer"),
    )
    data_plane: str = option(
        "driver",
        help="Where the samples' token data goes. driver: every response passes through the "
        "rl-train process (Samples, the buffer, per-rank batches pickled into Ray). workers: "
        "one rollout worker (a Ray actor) per node holding engines generates and scores its "
        "share of the step's prompts through the router and keeps the token ids and engine "
        "log-probs in Ray's object store; the driver gets each sample's reward, lengths, "
        "group, status and weight version, computes filters, advantages, the per-rank split "
        "and metrics as with driver, and each training rank fetches its own rows and keeps "
        "the old and reference log-probs it computes (the log-prob gap metric comes back "
        "as its scalars; same samples, rewards and loss for the same seed; docs/scale.md). "
        "workers runs every loop (sync, one_step_async, async: each worker holds the "
        "groups a weight update paused) with source=prompts, and refuses before Ray starts "
        "what reads token data on the driver: rollout_function, over_sampling > 1, "
        "sample_filter, post_process, dump_dir, rollout_only, replay_dir, "
        "logging.rollout_log_function, logging.dump_train_batch, "
        "algorithm.old_log_probs=rollout, algorithm.reward_kl_coef > 0, "
        "advantage_estimator=gae and distill.coef > 0.",
        choices=("driver", "workers"),
    )
    buffer_port: int = option(
        0, help="source=buffer: the buffer's port on engine.host (0: a free one).", low=0
    )
    buffer_min_ratio: float = option(
        1.0,
        help="source=buffer: a step trains on batch_size groups, or after buffer_timeout_s on "
        "what arrived if that is at least this fraction of them.",
        above=0,
        high=1,
    )
    buffer_timeout_s: float = option(
        600.0,
        help="source=buffer: how long a step waits for groups; fewer than buffer_min_ratio "
        "by then stops the run (exit 1; what arrived stays in the buffer for --resume).",
        above=0,
    )
    rollout_only: bool = option(False, help="Generate and score without training.")
    on_reward_error: str = option(
        "raise",
        help="A reward function that raises: stop the run (raise, exit 2) or leave the sample "
        "out and count it (skip): its group's advantages are taken over the samples that "
        "scored, and a group with fewer than two of them is dropped "
        "(rollout/groups_dropped_reward_error).",
        choices=("raise", "skip"),
    )
    reward_timeout_s: float | None = option(
        60.0,
        help="A reward taking longer is a failed one (handled per on_reward_error; NaN and "
        "inf rewards too); null = wait forever.",
        above=0,
    )


@dataclass(kw_only=True)
class EngineConfig:
    """Generation engines and weight sync."""

    kind: str = option(
        "embedded",
        help="Engine server: embedded (CPU or GPU) or sglang.",
        choices=("embedded", "sglang"),
    )
    num_engines: int = option(1, help="Engine servers.", low=1)
    devices_per_engine: int = option(
        1, help="Devices per engine (its tensor-parallel size).", low=1
    )
    use_router: bool = option(True, help="Put sglang-router in front of the engines.")
    max_context: int | None = option(
        None,
        help="Embedded engine: prompt + response tokens per request (its KV slot size); "
        "null = data.max_prompt_tokens + the longest response limit (the model's own limit "
        "with a custom rollout.function).",
        low=2,
    )
    host: str = option(
        "127.0.0.1",
        help="Address the engines and router bind to when the whole run is on the driver's "
        "node; engines on other nodes bind their node's address (RL_SGLANG_API_KEY then needed).",
    )
    mem_fraction: float = option(
        0.8,
        help="Share of its GPU's memory an engine may hold: SGLang's --mem-fraction-static; "
        "the embedded engine fits its KV slots (the requests it batches) into it.",
        above=0,
        high=1,
    )
    decode_attention: str = option(
        "auto",
        help="Embedded engine: the decode step's attention; auto = Triton kernels that read "
        "each row's own length on CUDA, SDPA with a length mask elsewhere.",
        choices=("auto", "triton", "sdpa"),
    )
    sampled_multi_step: bool = option(
        False,
        help="Embedded engine: sampled batches decode in rounds of several steps (each draw "
        "inside the round), as greedy ones do; a seeded sample's tokens are unchanged.",
    )
    weight_sync: str = option(
        "auto",
        help="Weight transport; auto picks tensor (colocated) or distributed (disaggregated).",
        choices=("auto", "tensor", "distributed", "disk"),
    )
    weight_sync_dir: str | None = option(
        None,
        help="Directory of weight_sync=disk, written by training rank 0 and read by every "
        "engine; null = <logging.run_dir>/sync_weights. A run over several nodes needs it "
        "on storage every node mounts at the same path (checked at start-up).",
    )
    weight_bucket_bytes: int = option(1 << 30, help="Bytes per weight-sync bucket.", low=1)
    weight_flatten: bool = option(
        True,
        help="Send each bucket as one flat buffer (SGLang's flattened_bucket format): one "
        "tensor handle or one broadcast per bucket instead of one per tensor.",
    )
    weight_buffer: str = option(
        "kept",
        help="weight_sync=tensor with weight_flatten: kept fills two send buffers per "
        "sending rank kept for the run (2 x weight_bucket_bytes at most, on the device also "
        "while a colocated trainer is offloaded), so the engine gets the same handles each "
        "sync and opens them once, "
        "and packs the next bucket while the engine applies one; fresh allocates one per "
        "bucket.",
        choices=("kept", "fresh"),
    )
    quantization: str = option(
        "none",
        help="fp8: the engines serve block-wise FP8 weights (float8_e4m3fn with one float32 "
        "weight_scale_inv per 128x128 block, DeepSeek-V3's layout; slime's FP8 rollout): "
        "the starting model is converted into <logging.run_dir>/initial_model_fp8 (its "
        "config.json's quantization_config tells SGLang) and every weight sync quantises "
        "the trainer's weights on the way, by every transport. Attention and MLP "
        "projections (and MoE experts) only; embeddings, norms, lm_head and router gates "
        "stay. SGLang runs FP8 matmuls (its triton block kernels); the embedded engine "
        "dequantises at load. Correct the trainer/engine gap with "
        "algorithm.rollout_is_level (TIS/MIS).",
        choices=("none", "fp8"),
    )
    sync_every: int = option(1, help="Sync weights every N training steps.", low=1)
    release_when_idle: bool = option(
        True,
        help="Colocated on GPUs: engines release weights, KV cache and CUDA graphs while the "
        "trainer works, and resume them for the weight sync (needs sync_every=1).",
    )
    freeze_gc: bool = option(
        True,
        help="After the first step, freeze each engine's garbage collector (SGLang's "
        "/freeze_gc; also after an engine restart): later full collections in the engine's "
        "processes skip the model, caches and tokenizer built at start-up.",
    )
    health_interval_s: float = option(
        5.0,
        help="Seconds between engine health checks; a dead engine is restarted, given the "
        "trainer's current weights and re-added to the router (0 = no checks).",
        low=0,
    )
    health_timeout_s: float = option(
        10.0, help="A health check not answered within this is a failed one.", above=0
    )
    max_restarts: int = option(3, help="Restarts per engine before it is left out.", low=0)
    sglang_args: list[str] = field(
        default_factory=list,
        metadata=meta("Server options passed through verbatim (--sglang-* on the command line)."),
    )


@dataclass(kw_only=True)
class DatasetConfig:
    """One prompt dataset (JSONL or Parquet)."""

    path: str = option(help="File path, optionally sliced by rows: data.jsonl@[100:200].")
    weight: float = option(1.0, help="Mixing weight among the datasets of a list.", low=0)
    name: str | None = option(None, help="Name in metrics; null = file stem.")
    prompt_key: str = option("prompt", help="Column with the prompt (text or chat messages).")
    label_key: str | None = option("label", help="Column with the label; null = none.")
    metadata_key: str | None = option("metadata", help="Column with a metadata mapping.")
    tools_key: str | None = option("tools", help="Column with tool schemas for the chat template.")
    response_key: str | None = option(
        "response",
        help="mode=sft: column with the target response (null: the chat messages' last "
        "assistant turn).",
    )
    chosen_key: str = option("chosen", help="mode=dpo: column with the preferred response (text).")
    rejected_key: str = option(
        "rejected", help="mode=dpo: column with the dispreferred response (text)."
    )


@dataclass(kw_only=True)
class DataConfig:
    """Prompt datasets and how they are read."""

    train: list[DatasetConfig] = field(
        default_factory=lambda: [DatasetConfig(path="examples/quickstart/data/train.jsonl")],
        metadata=meta("Training datasets, mixed by weight."),
    )
    apply_chat_template: bool = option(
        True, help="Format prompts with the tokenizer's chat template."
    )
    max_prompt_tokens: int = option(256, help="Longer prompts are filtered out and counted.", low=1)
    on_malformed: str = option(
        "skip", help="Malformed rows: skip (counted, reported) or raise.", choices=("skip", "raise")
    )
    shuffle: bool = option(True, help="Shuffle each epoch (seeded by the run's seed).")
    read_batch_rows: int = option(1024, help="Rows per record batch when streaming files.", low=1)
    source: str | None = option(
        None,
        help="Dotted path of a prompt source class, Source(data, *, seed, tokenizer) with "
        "next_prompt() -> Sample, state_dict() and load_state_dict(state) (its position, saved "
        "in checkpoints); null reads data.train (docs/extending.md).",
    )


@dataclass(kw_only=True)
class EvalConfig:
    """Periodic evaluation."""

    datasets: list[DatasetConfig] = field(
        default_factory=list, metadata=meta("Evaluation datasets.")
    )
    interval: int = option(0, help="Evaluate every N steps; 0 disables.", low=0)
    samples_per_prompt: int = option(1, help="Samples per eval prompt.", low=1)
    pass_k: list[int] = field(default_factory=lambda: [1], metadata=meta("k values of pass@k."))
    temperature: float = option(0.0, help="Eval sampling temperature.", low=0)
    max_response_tokens: int | None = option(
        None, help="Eval response limit; null = rollout.max_response_tokens.", low=1
    )
    greedy: bool = option(
        False,
        help="Also decode every eval prompt once at temperature 0 and report "
        "eval/<name>/greedy@1 (pass@1 of greedy decoding) beside the sampled pass@k.",
    )
    at_start: bool = option(
        False,
        help="Also evaluate the starting weights before step 1 (a step-0 record in "
        "metrics.jsonl; skipped on resume).",
    )


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and resuming."""

    dir: str | None = option(None, help="Checkpoint directory; null = <run_dir>/checkpoints.")
    interval: int = option(0, help="Save every N steps; 0 saves only at the end.", low=0)
    keep_last: int = option(2, help="Checkpoints kept on disk.", low=1)
    resume: bool | int | str = option(
        False,
        help="Resume: true = the newest loadable checkpoint (damaged newer ones are skipped, "
        "saying why); a step number or a checkpoint directory = that one (rl-train --resume "
        "[STEP|PATH]).",
    )
    save_hf: bool = option(False, help="Also export Hugging Face weights with each checkpoint.")
    save_on_stop: bool = option(
        True,
        help="On SIGTERM or SIGINT, save a checkpoint of the last completed step before "
        "exiting (exit 143 or 130; continue with --resume).",
    )
    stop_grace_s: float = option(
        10.0,
        help="After SIGTERM or SIGINT, how long a step still generating may take to finish; "
        "then it is abandoned (its prompts are drawn again on resume). A step that trains "
        "always finishes. A second signal exits at once.",
        low=0,
    )


@dataclass(kw_only=True)
class LoggingConfig:
    """What a person reads: progress, metrics, charts."""

    run_dir: str = option("runs/quickstart", help="Run directory (metrics.jsonl, plots, dumps).")
    progress: bool = option(True, help="Print a progress line per step.")
    tensorboard: bool = option(False, help="Write TensorBoard events to <run_dir>/tensorboard.")
    wandb: bool = option(False, help="Log to Weights & Biases.")
    wandb_project: str = option("rl", help="wandb project.")
    wandb_mode: str = option(
        "offline", help="wandb mode.", choices=("online", "offline", "disabled")
    )
    dump_train_batch: bool = option(
        False,
        help="RL: write each step's train batches as trained (per data-parallel rank: tokens, "
        "cu_seqlens, loss mask, advantages, old / reference / rollout log-probs, returns) "
        "to <run_dir>/train_batches/step_NNNNNN.pt, for torch.load (slime's "
        "--save-debug-train-data).",
    )
    rollout_log_function: str | None = option(
        None,
        help="Dotted path of fn(step, groups: list[list[Sample]]) -> dict[str, float]: extra "
        "metrics of every step, from the groups it trains on.",
    )


@dataclass(kw_only=True)
class TrainConfig:
    """A whole run."""

    mode: str = option(
        "rl",
        help="rl trains on rewards; sft on labelled responses; dpo on preference pairs "
        "(prompt, chosen, rejected) against the frozen starting model.",
        choices=("rl", "sft", "dpo"),
    )
    seed: int = option(
        42,
        help="Seed of data order, initialisation and sampling: embedded engines seed each "
        "prompt's requests from it and the prompt's draw number, so on CPU the same seed, "
        "machine and config give the same samples, rewards and losses. Not covered: SGLang "
        "servers (given it as --random-seed; their samples depend on batching), GPU kernels "
        "that are not deterministic (atomic adds in attention, matmul and scatter; see "
        "torch.use_deterministic_algorithms), other hardware or library versions.",
        low=0,
        high=2**32 - 1,
    )
    num_steps: int = option(20, help="Training steps.", low=1)
    cluster: ClusterConfig = field(
        default_factory=ClusterConfig, metadata=meta("Ray cluster and devices.")
    )
    model: ModelConfig = field(default_factory=ModelConfig, metadata=meta("Policy model."))
    backend: BackendConfig = field(
        default_factory=BackendConfig, metadata=meta("Training backend.")
    )
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, metadata=meta("Optimizer."))
    algorithm: AlgorithmConfig = field(
        default_factory=AlgorithmConfig, metadata=meta("RL algorithm.")
    )
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata=meta("Rollout."))
    engine: EngineConfig = field(default_factory=EngineConfig, metadata=meta("Engines."))
    data: DataConfig = field(default_factory=DataConfig, metadata=meta("Prompt data."))
    eval: EvalConfig = field(default_factory=EvalConfig, metadata=meta("Evaluation."))
    distill: DistillConfig = field(
        default_factory=DistillConfig, metadata=meta("On-policy distillation from a teacher.")
    )
    checkpoint: CheckpointConfig = field(
        default_factory=CheckpointConfig, metadata=meta("Checkpoints.")
    )
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata=meta("Logging."))
