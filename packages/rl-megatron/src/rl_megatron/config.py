"""Configuration of :class:`rl_megatron.backend.MegatronBackend`, validated once.

What the loss is comes from ``objective`` (:class:`rl_core.objective.Objective`, validated
there and shared with every backend); this config holds the model, its parallel layout
and the optimizer, and checks only what the layout demands of the objective.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_core.lr_schedule import check_schedule
from rl_core.objective import Objective
from rl_megatron.precision import PRECISIONS

MEGATRON_MODES = ("policy", "sft")  # Objective modes this backend trains (not yet "dpo")
# Under context parallelism a rank sees part of each sequence: only per-token sums add up.
CP_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
CP_POLICY_LOSSES = ("ppo", "cispo")
# SDPA kernel sets of core attention (rl_megatron.attention.KERNELS holds the kernels)
ATTENTION_BACKENDS = ("auto", "no_cudnn")


@dataclass(kw_only=True)
class MegatronConfig:
    """Everything the backend needs; every field is checked in ``__post_init__``."""

    hf_path: str | Path
    """HF model directory (config.json + *.safetensors) the weights are loaded from."""
    ref_path: str | Path | None = None
    """Reference-model directory for ``compute_log_probs(model="ref")``. None: ``hf_path``
    when the objective needs a reference (``objective.needs_reference``), else none."""
    objective: Objective = field(default_factory=Objective)
    """The loss (policy or SFT, clipping, KL, entropy, rollout correction, aggregation,
    temperature): rl_core.objective.Objective, shared with every backend."""
    train_only: tuple[str, ...] = ()
    """Train only parameters whose Hugging Face source names match one of these regular
    expressions (re.search; rl_core.freezing, as slime's --only-train-params-name-list);
    the rest are frozen and left out of the optimizer. A fused Megatron parameter (q/k/v,
    gate/up) trains when all its sources do; sources that disagree are refused. Empty = all."""
    freeze: tuple[str, ...] = ()
    """Freeze parameters whose Hugging Face source names match one of these regular
    expressions (after ``train_only``; slime's --freeze-params-name-list)."""
    critic: bool = False
    """Build a value head trained with the clipped value loss instead of the objective's
    policy (only the objective's aggregation applies)."""
    tp: int = 1
    """Tensor-parallel size."""
    sequence_parallel: bool = False
    """Split activations along the sequence between TP regions (tp > 1; needed for MoE + TP)."""
    pp: int = 1
    """Pipeline-parallel size (policy, SFT or critic; combines with tp, dp, cp and ep)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule with pp > 1: "1f1b" (at most pp micro-batches' activations held
    per stage) or "gpipe" (all forwards, then all backwards)."""
    vpp: int = 1
    """Model chunks per pipeline stage (megatron's ``virtual_pipeline_model_parallel_size``,
    also settable through :attr:`megatron`): with vpp > 1 each stage holds ``vpp``
    non-adjacent runs of layers and megatron-core's interleaved 1F1B schedule runs them
    (``pp_schedule`` is not used); dense or MoE (with or without ep), layers divisible by
    pp · vpp."""
    cp: int = 1
    """Context-parallel size: each sequence split zigzag over cp ranks (token-level losses
    only: ppo or cispo with token-mean or seq-mean-token-sum aggregation); combines with
    tp, pp, ep and vpp."""
    ep: int = 1
    """Expert-parallel size (MoE models; must divide the experts and dp · cp: megatron takes
    the expert-parallel ranks from the data- and context-parallel ones)."""
    device: str = "cuda"
    """"cuda", or "cpu" (gloo; needs rl_megatron.testing.cpu_shim installed first)."""
    precision: str | None = None
    """"bf16": bf16 parameters and compute (no autocast), fp32 main gradients accumulated
    per parameter and fp32 master weights in the optimizer, as Megatron trains; "fp32":
    everything float32 (exact parities). None: "bf16" on cuda, "fp32" on cpu."""
    swiglu_fusion: bool | None = None
    """SwiGLU through megatron's fused activation (``bias_activation_fusion``: one
    torch.compile'd kernel forward and one backward, saving only the MLP's input instead of
    four elementwise passes). None: on for cuda, off for cpu (compiling costs more there than
    it saves). Falls back to the unfused activation, with a warning, if it fails to compile."""
    compile_layers: bool | None = None
    """torch.compile each transformer layer as one graph, forward and backward (norms,
    rotary, residual adds fused around the matmuls and attention; no host time between
    kernels): dense layers at tp = 1 whole (any pp, vpp, cp), the others (MoE layers,
    tp > 1, selective recompute) their RMSNorms only (:mod:`rl_megatron.compiled_layers`).
    A layer class whose compilation fails runs eager, logged once. None: on for cuda, off
    for cpu (compiling costs more there than it saves)."""
    rotary_table: bool = True
    """Rotary embedding from a cos/sin table made once per sequence length (in the
    parameters' dtype) instead of megatron taking cos and sin of the angles in every layer:
    the same values, loads and multiply-adds per layer (:mod:`rl_megatron.rotary`; plain
    rope only, MLA / YaRN keep megatron's path)."""
    fused_qkv_rotary: bool = True
    """With the cos/sin table: queries and keys rotated straight from the fused q/k/v
    projection's output, one Triton kernel forward and one backward on CUDA (bf16/fp16)
    that write contiguous q, k, v and the projection's gradient, instead of megatron
    splitting it into strided views and rotating those; the same values
    (:mod:`rl_megatron.qkv_rotary`; models without q/k norms or interleaved rope). On an
    H100 it took the 1.5B step from 203 to 191 ms (the split's two kernels took 13.6 ms)."""
    attention_backends: str = "auto"
    """SDPA kernels of core attention (:data:`ATTENTION_BACKENDS`, :mod:`rl_megatron.attention`):
    "auto" lets SDPA pick (cuDNN's fused attention first on Hopper, which builds a plan,
    tens of ms, for every new micro-batch shape), "no_cudnn" flash / memory-efficient /
    math only. The same results up to the kernels' rounding."""
    width_bucket: int = 1
    """Padded row widths are rounded up to a multiple of this (and of the layout's own
    multiple: tp, 2·cp·tp): fewer distinct micro-batch shapes, so kernels that plan or
    compile per shape (cuDNN attention, Inductor's dynamic-shape guards) see repeats, for
    at most ``width_bucket - 1`` padding columns a row (masked: the same log-probs, loss
    and gradients up to the matmuls' rounding, whose kernels may block by the token count;
    a micro-batch may exceed ``max_tokens_per_micro_batch`` by that much). 1 = off."""
    seed: int = 1234
    lr: float = 1e-6
    warmup_steps: int = 0
    """Linear warm-up from ``lr / warmup_steps`` to ``lr`` over this many optimizer steps."""
    lr_decay: str = "constant"
    """After warm-up: "constant", "linear" or "cosine" down to ``min_lr_ratio * lr`` at
    ``total_steps`` (rl_core.lr_schedule, the schedule rl-fsdp steps by too)."""
    total_steps: int | None = None
    """Length of the schedule in optimizer steps (needed by linear and cosine)."""
    min_lr_ratio: float = 0.0
    """Final lr / peak lr of a decaying schedule."""
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    distributed_optimizer: bool = True
    """With dp > 1, shard the AdamW state over data-parallel ranks (ZeRO-1)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (over all TP shards); 0 disables clipping."""
    max_tokens_per_micro_batch: int = 8192
    """Token budget of one micro-batch (first-fit packing of whole sequences)."""
    value_clip: float | None = None
    """Critic only: clip of the value update around old_values."""
    logprob_chunk_size: int = 1024
    """Rows per chunk of the vocab-parallel softmax."""
    megatron: dict[str, Any] = field(default_factory=dict)
    """megatron-core options by field name (``{"recompute_granularity": "full", ...}``):
    TransformerConfig fields go into the model's config as given; of the DDP / optimizer
    configs only ``use_distributed_optimizer`` (sets ``distributed_optimizer``). Unknown
    names and the fields this config sets itself (parallel sizes, dtype, shape, lr, ...)
    are refused (:mod:`rl_megatron.options`)."""

    def __post_init__(self):
        self.hf_path = Path(self.hf_path)
        if not (self.hf_path / "config.json").exists():
            raise ValueError(
                f"hf_path {self.hf_path} has no config.json; point it at an HF model dir"
            )
        if not isinstance(self.objective, Objective):
            raise ValueError(
                f"objective must be an rl_core.objective.Objective, got {type(self.objective)}"
            )
        if self.objective.mode not in MEGATRON_MODES:
            raise ValueError(
                f"objective mode {self.objective.mode!r}: rl-megatron trains "
                f"{' and '.join(MEGATRON_MODES)} objectives; run it on the fsdp backend"
            )
        if self.ref_path is None and self.objective.needs_reference and not self.critic:
            self.ref_path = self.hf_path
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.precision is None:
            self.precision = "bf16" if self.device == "cuda" else "fp32"
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision must be one of {', '.join(PRECISIONS)} (or None), got {self.precision!r}"
            )
        if self.swiglu_fusion is None:
            self.swiglu_fusion = self.device == "cuda"
        if self.compile_layers is None:
            self.compile_layers = self.device == "cuda"
        for name, value in self.megatron_options().routed.items():
            setattr(self, name, value)
        _positive(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, vpp=self.vpp)
        _positive(max_tokens_per_micro_batch=self.max_tokens_per_micro_batch)
        _positive(width_bucket=self.width_bucket)
        self._check_attention_backends()
        _positive(lr=self.lr, logprob_chunk_size=self.logprob_chunk_size)
        check_schedule(
            lr_decay=self.lr_decay,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            min_lr_ratio=self.min_lr_ratio,
        )
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables), got {self.clip_grad}")
        if self.cp > 1:
            self._check_context_parallel()
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(
                f"vpp={self.vpp} (virtual pipeline stages) splits each pipeline stage; it "
                "needs pp > 1: set pp, or vpp=1"
            )
        if self.pp > 1:
            self._check_layer_split()
        if self.pp_schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"pp_schedule must be '1f1b' or 'gpipe', got {self.pp_schedule!r}")

    def megatron_options(self):
        """:attr:`megatron` checked and split (:func:`rl_megatron.options.split_options`)."""
        from rl_megatron.options import split_options

        return split_options(self.megatron)

    @property
    def role(self) -> str:
        """ "policy", "sft" (the objective's mode) or "critic": what the model is trained as."""
        return "critic" if self.critic else self.objective.mode

    def _check_attention_backends(self) -> None:
        if self.attention_backends not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backends must be one of {', '.join(map(repr, ATTENTION_BACKENDS))}, "
                f"got {self.attention_backends!r}"
            )

    def _check_layer_split(self) -> None:
        """megatron builds the same number of layers in each of the pp · vpp model chunks."""
        from rl_megatron.weights import hf_config_of

        layers, chunks = hf_config_of(self.hf_path).num_hidden_layers, self.pp * self.vpp
        if layers % chunks:
            raise ValueError(
                f"{self.hf_path} has {layers} layers, which do not split evenly over pp={self.pp}"
                f" x vpp={self.vpp} = {chunks} model chunks (megatron builds as many layers in "
                f"each); pick pp and vpp whose product divides {layers}"
            )

    def _check_context_parallel(self) -> None:
        """Under CP a rank sees part of each sequence: only per-token sums add up."""
        objective = self.objective
        if objective.loss_agg_mode not in CP_AGG_MODES:
            raise ValueError(
                f"cp > 1 cannot aggregate with loss_agg_mode={objective.loss_agg_mode!r}; "
                f"use one of {', '.join(CP_AGG_MODES)}"
            )
        if self.role == "policy" and objective.policy_loss not in CP_POLICY_LOSSES:
            raise ValueError(
                f"cp > 1 needs a token-level policy_loss ({', '.join(CP_POLICY_LOSSES)}), "
                f"not {objective.policy_loss!r}"
            )
        if objective.rollout_is_level == "sequence":
            raise ValueError("cp > 1 needs rollout_is_level 'token' (or None)")


def _positive(**values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
