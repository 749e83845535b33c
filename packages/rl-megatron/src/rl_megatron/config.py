"""Configuration of :class:`rl_megatron.backend.MegatronBackend`, validated once."""

from dataclasses import dataclass
from pathlib import Path

from rl_core.aggregation import AGGREGATION_MODES
from rl_core.importance import IS_LEVELS, IS_MODES
from rl_core.losses import POLICY_LOSSES
from rl_megatron.precision import PRECISIONS

MODES = ("policy", "sft", "critic")


@dataclass(kw_only=True)
class MegatronConfig:
    """Everything the backend needs; every field is checked in ``__post_init__``."""

    hf_path: str | Path
    """HF model directory (config.json + *.safetensors) the weights are loaded from."""
    ref_path: str | Path | None = None
    """Reference-model directory for ``compute_log_probs(model="ref")``; None: no reference."""
    mode: str = "policy"
    """"policy" (RL loss), "sft" (negative log-likelihood) or "critic" (value head)."""
    tp: int = 1
    """Tensor-parallel size."""
    sequence_parallel: bool = False
    """Split activations along the sequence between TP regions (tp > 1; needed for MoE + TP)."""
    pp: int = 1
    """Pipeline-parallel size (policy/SFT, with tp and dp, not cp/ep)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule with pp > 1: "1f1b" (at most pp micro-batches' activations held
    per stage) or "gpipe" (all forwards, then all backwards)."""
    cp: int = 1
    """Context-parallel size: each sequence split zigzag over cp ranks (token-level losses
    only: ppo or cispo with token-mean or seq-mean-token-sum aggregation)."""
    ep: int = 1
    """Expert-parallel size (MoE models; must divide the data-parallel ranks and experts)."""
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
    seed: int = 1234
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    distributed_optimizer: bool = True
    """With dp > 1, shard the AdamW state over data-parallel ranks (ZeRO-1)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (over all TP shards); 0 disables clipping."""
    max_tokens_per_micro_batch: int = 8192
    """Token budget of one micro-batch (first-fit packing of whole sequences)."""
    loss_name: str = "ppo"
    """Policy loss from rl_core.losses.POLICY_LOSSES (ppo, gspo, cispo, ...)."""
    clip_low: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_kind: str = "low_var_kl"
    agg_mode: str = "token-mean"
    norm_length: float | None = None
    """seq-mean-token-sum-norm's constant divisor (Dr.GRPO: the response limit); the packed
    batches have no padded width to default to."""
    rollout_is_cap: float | None = None
    """Correct for rollout/trainer mismatch with importance weights pi_old / pi_rollout
    capped at this value (needs batch.rollout_log_probs); None: off."""
    rollout_is_level: str = "token"
    """"token" or "sequence" importance ratios."""
    rollout_is_mode: str = "truncate"
    """"truncate" (TIS: min(w, cap)) or "mask" (MIS: drop tokens outside [1/cap, cap])."""
    value_clip: float | None = None
    """Critic only: clip of the value update around old_values."""
    temperature: float = 1.0
    """Sampling temperature of the rollout; logits are divided by it."""
    logprob_chunk_size: int = 1024
    """Rows per chunk of the vocab-parallel softmax."""

    def __post_init__(self):
        self.hf_path = Path(self.hf_path)
        if not (self.hf_path / "config.json").exists():
            raise ValueError(
                f"hf_path {self.hf_path} has no config.json; point it at an HF model dir"
            )
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} unknown; choose one of {', '.join(MODES)}")
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
        _positive(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep)
        _positive(max_tokens_per_micro_batch=self.max_tokens_per_micro_batch)
        _positive(
            lr=self.lr, temperature=self.temperature, logprob_chunk_size=self.logprob_chunk_size
        )
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables), got {self.clip_grad}")
        if self.agg_mode not in AGGREGATION_MODES:
            raise ValueError(
                f"agg_mode {self.agg_mode!r} unknown; choose one of {AGGREGATION_MODES}"
            )
        if self.agg_mode == "seq-mean-token-sum-norm" and not (self.norm_length or 0) > 0:
            raise ValueError("agg_mode='seq-mean-token-sum-norm' needs norm_length > 0 "
                             "(the response limit it divides by)")  # fmt: skip
        if self.mode == "policy":
            POLICY_LOSSES.get(self.loss_name)  # raises with the known names
        if self.rollout_is_level not in IS_LEVELS or self.rollout_is_mode not in IS_MODES:
            raise ValueError(
                f"rollout_is_level must be one of {IS_LEVELS} and rollout_is_mode one of {IS_MODES}"
            )
        if self.cp > 1:
            self._check_context_parallel()
        if self.pp > 1 and (self.mode == "critic" or self.cp > 1 or self.ep > 1):
            raise ValueError("pp > 1 supports policy and sft modes with tp and dp (cp=1, ep=1)")
        if self.pp_schedule not in ("1f1b", "gpipe"):
            raise ValueError(f"pp_schedule must be '1f1b' or 'gpipe', got {self.pp_schedule!r}")
        if self.kl_coef and self.ref_path is None:
            raise ValueError("kl_coef > 0 needs ref_path (the reference model's HF directory)")

    def _check_context_parallel(self) -> None:
        """Under CP a rank sees part of each sequence: only per-token sums add up."""
        if self.agg_mode not in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
            raise ValueError(f"cp > 1 cannot aggregate with {self.agg_mode!r}; use token-mean")
        if self.mode == "policy" and self.loss_name not in ("ppo", "cispo"):
            raise ValueError(
                f"cp > 1 needs a token-level loss (ppo, cispo), not {self.loss_name!r}"
            )
        if self.rollout_is_level != "token" or self.ep != 1:
            raise ValueError("cp > 1 needs rollout_is_level='token' and ep=1")


def _positive(**values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
