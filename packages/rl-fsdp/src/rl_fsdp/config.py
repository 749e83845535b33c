"""The one configuration object of the FSDP backend (actor, reference and critic alike).

Keyword-only, every field documented, validated once in ``__post_init__`` with a
ValueError that names the field and says how to fix it. What the loss is comes from
``objective`` (:class:`rl_core.objective.Objective`, validated there); this config holds how
the model is built, sharded, batched and optimised.
"""

from dataclasses import dataclass, field
from typing import Any

from rl_core.lr_schedule import LR_DECAYS, check_schedule
from rl_core.objective import Objective
from rl_fsdp.lora import LoRASpec

ATTENTION_IMPLS = (
    "auto",
    "flash_varlen",
    "torch_varlen",
    "flex",
    "sdpa_mask",
    "sdpa_grouped",
    "sdpa_per_doc",
)
PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "sgd")


@dataclass(kw_only=True)
class FSDPConfig:
    # --- model -------------------------------------------------------------------------
    model_path: str | None = None
    """Local Hugging Face directory to load (config + safetensors). Exactly one of
    ``model_path`` / ``model_config`` must be set."""
    model_config: dict[str, Any] | None = None
    """HF config fields incl. ``model_type`` (qwen2, qwen3, llama, ...): random init."""
    seed: int = 0
    """Seed of the random init (identical on every rank) and of the RNG afterwards."""
    device: str = "auto"
    """"cpu", "cuda" or "auto" (cuda when available). CPU uses gloo, cuda uses nccl."""
    precision: str = "fp32"
    """"fp32" (everything fp32) or "bf16" (bf16 compute and all-gather, fp32 master
    weights and fp32 gradient reduction)."""
    attention: str = "auto"
    """Packed attention: "flash_varlen" (flash-attn), "torch_varlen" (the same varlen
    kernel shipped in torch >= 2.10, bf16 on cuda; a micro-batch of sequences of one
    length runs one batched causal SDPA call instead), "flex" (FlexAttention with a
    document-causal block mask, compiled on cuda), "sdpa_mask" (one SDPA call with a
    block-diagonal causal mask), "sdpa_grouped" (sequences of similar length padded into a
    few batched causal SDPA calls), "sdpa_per_doc" (one causal SDPA per sequence) or "auto"
    (on cuda with bf16: flash_varlen if installed, else torch_varlen if torch has it and a
    probe passes, else sdpa_grouped; sdpa_grouped on cpu; flex is opt-in)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward pass (less memory, ~1/3 more compute)."""
    compile_layers: bool = False
    """torch.compile each decoder layer (fuses norms, rotary, SwiGLU; CUDA only; not with
    activation_checkpointing). The first steps compile (tens of seconds); best with
    attention "flex" (other implementations break the graph or recompile per layout)."""
    compile_blocks: bool | None = None
    """torch.compile each decoder layer whole (``compile_attention``; fused norms, SwiGLU,
    rotary, forward and backward; with attention "torch_varlen" or "sdpa_mask" the kernel
    is traced too: one graph per layer, no graph break), else each MLP and RMSNorm
    (:mod:`rl_fsdp.fusion`). A module class whose compilation fails runs eager. None = on
    for device cuda without activation_checkpointing / compile_layers; True works on CPU."""
    compile_attention: bool = True
    """With compile_blocks: compile the attention with the layer (the other packed
    implementations run eager behind a graph break inside it); False compiles only MLPs
    and RMSNorms. Not with attention "flex" (its kernel is compiled per length bucket on
    its own)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on CPU (FSDP2 offload policy)."""
    fsdp_on_one_rank: bool | None = None
    """Shard with FSDP2 on a single rank too. None = only with ``cpu_offload``; a single
    rank (CPU or GPU) otherwise keeps float32 master parameters and its compute copy itself
    (:mod:`rl_fsdp.master`: the same arithmetic without FSDP's per-step gather and
    reduce copies, which communicate nothing on one rank)."""
    reshard_after_forward: bool | None = None
    """Free gathered layer weights after forward (ZeRO-3); False keeps them (ZeRO-2-like:
    the backward needs no second all-gather and cast). None = False on a single rank
    without cpu_offload (nothing to save: the shard is the whole layer), True otherwise."""
    reshard_after_backward: bool | None = None
    """Free gathered layer weights after every micro-batch's backward. None = the same as
    ``reshard_after_forward``: on a single rank the layers then stay gathered through a
    step's micro-batches and are freed once after the last (no re-gather and bf16 re-cast
    per micro-batch; the same numbers bit for bit)."""
    reduce_dtype: str | None = None
    """dtype of the gradient reduction ("fp32" or "bf16"). None = fp32, except on a single
    rank where it is the compute dtype: nothing is summed there, so the result is the same
    bit for bit and the float32 copy of every gradient is skipped."""
    reference: bool | None = None
    """Build a frozen reference copy of the initial weights (for ``model="ref"`` log-probs).
    None = when the objective needs one (``objective.needs_reference``)."""
    ref_path: str | None = None
    """Hugging Face directory of the reference model (same architecture and tokenizer);
    None = the policy's initial weights (``model_path`` / ``model_config`` and seed)."""
    ref_offload: bool = False
    """Keep the reference model's shards on CPU between uses (moved in for each call)."""
    lora: LoRASpec | None = None
    """LoRA adapters on the policy (:mod:`rl_fsdp.lora`), added before sharding: only they
    train, the optimizer and checkpoints hold only them, the reference is the base with
    the adapters off (no second copy), and exported weights are merged (HF names, for any
    transport). Without FSDP the frozen base is kept in the compute dtype, the adapters in
    float32. The critic (:class:`rl_fsdp.FSDPCritic`) ignores it and trains in full."""
    train_only: tuple[str, ...] = ()
    """Train only parameters whose Hugging Face name matches one of these regular
    expressions (re.search; rl_core.freezing, as slime's --only-train-params-name-list);
    the rest are frozen and left out of the optimizer. Empty = all."""
    freeze: tuple[str, ...] = ()
    """Freeze parameters whose Hugging Face name matches one of these regular expressions
    (after ``train_only``; slime's --freeze-params-name-list)."""
    # --- batching ----------------------------------------------------------------------
    max_tokens_per_micro_batch: int = 8192
    """Token budget of one packed micro-batch (rl_core.packing.first_fit_pack)."""
    log_prob_max_tokens: int | None = None
    """Token budget for no-grad log-prob passes; None = ``max_tokens_per_micro_batch``."""
    logits_chunk_size: int = 1024
    """Rows per chunk of the log-softmax over the vocabulary (rl_core.logprobs)."""
    # --- loss --------------------------------------------------------------------------
    objective: Objective = field(default_factory=Objective)
    """The loss (policy or SFT, clipping, KL, entropy, rollout correction, aggregation,
    temperature): rl_core.objective.Objective, shared with every backend."""
    value_clip: float | None = 0.2
    """Critic only: clip range of the PPO value loss (None = unclipped)."""
    # --- optimizer ---------------------------------------------------------------------
    optimizer: str = "adamw"
    """"adamw" (betas, eps, decoupled weight decay) or "sgd" (``momentum``; its weight
    decay is added to the gradient, which equals AdamW's decoupled decay without momentum)."""
    momentum: float = 0.0
    """SGD only: momentum in [0, 1); 0 is plain SGD, w - lr * grad."""
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    """Linear warmup from 0 to ``lr`` over this many optimizer steps."""
    lr_decay: str = "constant"
    """After warmup: "constant", "linear" or "cosine" down to ``min_lr_ratio * lr``."""
    total_steps: int | None = None
    """Length of the schedule; required by linear and cosine decay."""
    min_lr_ratio: float = 0.0
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; None disables clipping."""
    # --- export and metrics ------------------------------------------------------------
    export_dtype: str | None = None
    """dtype of exported weights ("bf16", "fp32"); None = the master weights' dtype."""
    peak_tflops: float | None = None
    """Measured or nominal bf16 matmul rate per GPU, for the MFU metric (None: no MFU)."""

    def __post_init__(self):
        self._check_model()
        self._check_choices()
        self._check_numbers()

    def _check_model(self):
        if (self.model_path is None) == (self.model_config is None):
            raise ValueError(
                "set exactly one of model_path (a local HF directory) or model_config "
                "(HF config fields with model_type, for a random init)"
            )
        if self.model_config is not None and "model_type" not in self.model_config:
            raise ValueError("model_config needs a model_type, e.g. {'model_type': 'qwen2', ...}")

    def _check_choices(self):
        choices = {
            "device": ("auto", "cpu", "cuda"),
            "precision": PRECISIONS,
            "attention": ATTENTION_IMPLS,
            "lr_decay": LR_DECAYS,
            "optimizer": OPTIMIZERS,
            "export_dtype": (None, *PRECISIONS),
            "reduce_dtype": (None, *PRECISIONS),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of: {allowed}")

    def _check_numbers(self):
        positive = ["max_tokens_per_micro_batch", "logits_chunk_size", "lr", "eps"]
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.log_prob_max_tokens is not None and self.log_prob_max_tokens < 1:
            raise ValueError(f"log_prob_max_tokens must be >= 1, got {self.log_prob_max_tokens}")
        if not 0.0 <= self.momentum < 1.0 or (self.momentum and self.optimizer != "sgd"):
            raise ValueError(
                f"momentum must be in [0, 1) and 0 unless optimizer='sgd', got "
                f"{self.momentum} with optimizer={self.optimizer!r}"
            )
        check_schedule(
            lr_decay=self.lr_decay,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            min_lr_ratio=self.min_lr_ratio,
        )
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {self.max_grad_norm}")
        if not isinstance(self.objective, Objective):
            raise ValueError(
                f"objective must be an rl_core.objective.Objective, got {type(self.objective)}"
            )
        if self.lora is not None and not isinstance(self.lora, LoRASpec):
            raise ValueError(f"lora must be an rl_fsdp.lora.LoRASpec or None, got {self.lora!r}")
        if self.ref_offload and self.lora is not None:
            raise ValueError(
                "ref_offload=True: with lora the reference is the base model "
                "itself (adapters off), nothing to offload; drop ref_offload"
            )
        if self.ref_offload and not self.loads_reference:
            raise ValueError("ref_offload=True needs a reference (reference=True, or a KL term)")
        if self.cpu_offload and self.fsdp_on_one_rank is False:
            raise ValueError(
                "cpu_offload=True is FSDP2's offload policy; drop fsdp_on_one_rank=False"
            )
        if self.compile_layers and self.activation_checkpointing:
            raise ValueError(
                "compile_layers=True with activation_checkpointing=True runs the layers "
                "uncompiled (torch.compile falls back to eager at Hugging Face's checkpoint "
                "call inside each layer); choose one of them"
            )

        if self.compile_blocks and self.compile_layers:
            raise ValueError("compile_layers=True already compiles the blocks; drop compile_blocks")

    @property
    def loads_reference(self) -> bool:
        """Whether the backend builds the frozen reference model."""
        return self.objective.needs_reference if self.reference is None else self.reference

    @property
    def micro_batch_tokens_for_log_probs(self) -> int:
        return self.log_prob_max_tokens or self.max_tokens_per_micro_batch
