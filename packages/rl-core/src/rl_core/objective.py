"""What a trainer optimises, described once (:class:`Objective`), and the full RL training
loss of one micro-batch: policy loss, KL to the reference, entropy bonus and rollout
importance correction, aggregated with the step's global denominators.

Both training backends carry one :class:`Objective` (the launcher builds it from its
``algorithm.*`` options, whose names its fields share) and hand it to
:func:`objective_loss` with the tensors they computed. :func:`policy_objective` and
:func:`sft_objective` read no config object. Every value in the returned metrics is this
micro-batch's share of the step-wide mean (computed with the same global denominators), so
summing metrics over micro-batches and data-parallel ranks gives the step's metric.
"""

import math
from dataclasses import dataclass

import torch

from rl_core.aggregation import AGGREGATION_MODES, aggregate, load_reducer
from rl_core.batch import TrainBatch
from rl_core.importance import (
    IS_LEVELS,
    IS_MODES,
    logprob_gap_share,
    off_policy_sequence_mask,
    rollout_importance_weights,
)
from rl_core.kl import KL_KINDS, approx_kl, importance_weighted_kl
from rl_core.losses import POLICY_LOSSES, entropy_loss, sft_loss
from rl_core.preference import PREFERENCE_LOSSES, packed_pair_loss
from rl_core.registry import is_dotted

OBJECTIVE_MODES = ("policy", "sft", "dpo")


@dataclass(frozen=True, kw_only=True)
class Objective:
    """The loss a policy is trained with; validated once, read by every backend.

    Field names are the launcher's ``algorithm.*`` option names wherever one exists, so a
    new term is one field here (and one option of the same name there). OPD / DPO terms
    join as fields the same way.
    """

    mode: str = "policy"
    """"policy" (RL policy loss with KL, entropy and importance terms), "sft" (negative
    log-likelihood of the loss-masked tokens; only the aggregation applies) or "dpo"
    (preference pairs against the frozen reference: the ``dpo_*`` fields)."""
    policy_loss: str = "ppo"
    """Policy loss from rl_core.losses.POLICY_LOSSES (ppo, gspo, cispo, ...), or a dotted
    path ``pkg.module:function`` to one of the same signature (losses.POLICY_LOSS_SHAPE)."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one number (rl_core.aggregation.AGGREGATION_MODES), or a
    dotted path to a reducer of aggregate's signature (aggregation.REDUCER_SHAPE). Dotted
    paths are imported where the objective is built and again where a backend uses it, so
    both backends train with them and no backend has code of its own for them."""
    norm_length: float | None = None
    """Constant divisor of "seq-mean-token-sum-norm" (Dr.GRPO: the response limit);
    required by that mode, since packed batches have no padded width to default to."""
    clip_low: float = 0.2
    """Lower ratio clip: ratios below 1 - clip_low are clipped."""
    clip_high: float | None = None
    """Upper ratio clip (1 + clip_high); None = clip_low (set higher for DAPO clip-higher)."""
    dual_clip: float | None = None
    """Dual-clip bound c (> 1) for negative advantages; None disables it."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    kl_coef: float = 0.0
    """Weight of KL(actor || reference) in the loss; needs reference log-probs."""
    kl_kind: str = "low_var_kl"
    """KL estimator of the loss term (rl_core.kl.KL_KINDS)."""
    unbiased_kl: bool = False
    """The loss's KL term weighted by pi / pi_old (rl_core.kl.importance_weighted_kl):
    unbiased when the tokens were sampled by an older policy (slime --use-unbiased-kl)."""
    opsm: bool = False
    """Off-policy sequence masking (rl_core.importance.off_policy_sequence_mask; slime
    --use-opsm): sequences with a negative advantage whose old-to-current drift exceeds
    ``opsm_delta`` leave the policy loss."""
    opsm_delta: float = 1e-4
    """OPSM's bound on a sequence's mean (old - current) log-prob (slime --opsm-delta)."""
    old_from_rollout: bool = False
    """The batch's old log-probs are the engine's sampled ones (no trainer recompute):
    the train step then reports its own forward's gap to them as the mismatch metric."""
    reward_kl_coef: float = 0.0
    """KL-to-reference penalty folded into the rewards before the advantages (not a loss
    term); with ``kl_coef`` it decides whether a reference model is loaded."""
    rollout_is_level: str | None = None
    """Rollout importance correction pi_old / pi_rollout: "token", "sequence" or None (off)."""
    rollout_is_mode: str = "truncate"
    """"truncate" (TIS: min(w, cap)) or "mask" (MIS: drop tokens outside [1/cap, cap])."""
    rollout_is_cap: float = 2.0
    """Upper bound of the importance weight."""
    temperature: float = 1.0
    """Sampling temperature of the rollout; logits are divided by it, as engines do."""
    dpo_loss: str = "sigmoid"
    """mode "dpo": the preference loss (rl_core.preference.PREFERENCE_LOSSES)."""
    dpo_beta: float = 0.1
    """mode "dpo": strength of the implicit KL constraint to the reference (> 0)."""
    dpo_label_smoothing: float = 0.0
    """mode "dpo", sigmoid loss: the assumed share of flipped labels, in [0, 0.5)."""

    def __post_init__(self):
        self._check_choices()
        self._check_bounds()
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.norm_length is None:
            raise ValueError(
                "loss_agg_mode='seq-mean-token-sum-norm' needs norm_length (the response "
                "limit it divides by)"
            )

    def _check_choices(self) -> None:
        dotted = {"policy_loss": POLICY_LOSSES.get, "loss_agg_mode": load_reducer}
        for name, load in dotted.items():
            if is_dotted(getattr(self, name)):
                load(getattr(self, name))  # imported and its signature checked here
        choices = {
            "mode": OBJECTIVE_MODES,
            "policy_loss": tuple(POLICY_LOSSES.names()),
            "loss_agg_mode": AGGREGATION_MODES,
            "kl_kind": KL_KINDS,
            "rollout_is_level": (None, *IS_LEVELS),
            "rollout_is_mode": IS_MODES,
            "dpo_loss": PREFERENCE_LOSSES,
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed and not (name in dotted and is_dotted(value)):
                known = ", ".join(str(choice) for choice in allowed)
                path = " or a dotted path 'pkg.module:function'" if name in dotted else ""
                raise ValueError(f"{name}={value!r} unknown; choose one of: {known}{path}")

    def _check_bounds(self) -> None:
        """Every number finite; coefficients and clips >= 0, scales > 0, dual_clip > 1."""
        at_least_zero = (
            "clip_low",
            "clip_high",
            "entropy_coef",
            "kl_coef",
            "reward_kl_coef",
            "dpo_label_smoothing",
            "opsm_delta",
        )
        above_zero = ("norm_length", "rollout_is_cap", "temperature", "dpo_beta")
        for name in (*at_least_zero, *above_zero, "dual_clip"):
            value = getattr(self, name)
            if value is None:
                continue
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
            if name in at_least_zero and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
            if name in above_zero and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not self.dpo_label_smoothing < 0.5:
            raise ValueError(f"dpo_label_smoothing must be < 0.5, got {self.dpo_label_smoothing}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (or None to disable), got {self.dual_clip}")
        if self.old_from_rollout and self.rollout_is_level is not None:
            raise ValueError(
                "old_from_rollout makes pi_old the rollout policy, so rollout importance "
                "weights would all be 1: set rollout_is_level=None (or recompute old log-probs)"
            )

    @property
    def needs_reference(self) -> bool:
        """Whether a frozen reference model must be loaded (KL in the loss or the reward,
        or DPO's reference log-probs)."""
        return self.kl_coef > 0 or self.reward_kl_coef > 0 or self.mode == "dpo"

    @property
    def corrects_rollout(self) -> bool:
        """Whether the policy loss is weighted by rollout importance weights."""
        return self.rollout_is_level is not None


def aggregate_batch(
    objective: Objective, per_token: torch.Tensor, batch: TrainBatch
) -> torch.Tensor:
    """``per_token`` ``[N]`` values of the packed ``batch`` reduced as the objective reduces
    its losses (``loss_agg_mode``, ``norm_length``) over the step's global denominators
    (``batch.global_num_tokens`` / ``global_num_seqs``): a critic's value loss, a reported KL."""
    return aggregate(
        per_token,
        batch.loss_mask,
        mode=objective.loss_agg_mode,
        cu_seqlens=batch.cu_seqlens,
        num_tokens=batch.global_num_tokens,
        num_seqs=batch.global_num_seqs,
        norm_length=objective.norm_length,
    )


def policy_inputs(
    objective: Objective,
    batch: TrainBatch,
    log_probs: torch.Tensor,
    *,
    tensor_metrics: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """``(old log-probs, rollout importance weights or None, their metrics)`` of one packed
    micro-batch of a policy step, as both backends need them. On-policy (the detached
    ``log_probs``, ratio 1) when the batch has no old log-probs. Without a recompute pass
    (none, or old log-probs taken from the rollout) this forward's gap to the engine's
    log-probs is ``mismatch/logprob_abs_diff_mean``. Metrics are this micro-batch's share of
    the step (summing a step's micro-batches gives the mean); tensors with
    ``tensor_metrics`` (no host sync), floats otherwise."""
    if batch.advantages is None:
        raise ValueError("a policy objective needs batch.advantages (or use mode='sft')")
    old = batch.old_log_probs if batch.old_log_probs is not None else log_probs.detach()
    weights, metrics = _rollout_correction(objective, batch, old, tensor_metrics)
    own_gap = batch.old_log_probs is None or objective.old_from_rollout
    if own_gap and batch.rollout_log_probs is not None:  # no recompute measured the gap
        gap = logprob_gap_share(
            log_probs,
            batch.rollout_log_probs,
            batch.loss_mask,
            num_tokens=batch.global_num_tokens or 1.0,
        )
        metrics["mismatch/logprob_abs_diff_mean"] = gap if tensor_metrics else float(gap)
    return old, weights, metrics


def _rollout_correction(
    objective: Objective, batch: TrainBatch, old: torch.Tensor, tensor_metrics: bool
) -> tuple[torch.Tensor | None, dict]:
    """Rollout importance weights ``[N]`` (None when the objective has none) and their
    metrics scaled by this micro-batch's share of the step's valid tokens."""
    if not objective.corrects_rollout:
        return None, {}
    if batch.rollout_log_probs is None:
        raise ValueError("rollout_is_level is set but the batch has no rollout_log_probs")
    weights, metrics = rollout_importance_weights(
        old,
        batch.rollout_log_probs,
        batch.loss_mask,
        level=objective.rollout_is_level,
        mode=objective.rollout_is_mode,
        cap=objective.rollout_is_cap,
        cu_seqlens=batch.cu_seqlens,
        tensor_metrics=tensor_metrics,
    )
    share = batch.loss_mask.sum().to(torch.float64) / max(float(batch.global_num_tokens or 1), 1.0)
    if not tensor_metrics:
        share = float(share)
    return weights, {key: value * share for key, value in metrics.items()}


def batch_objective_loss(
    objective: Objective,
    batch: TrainBatch,
    log_probs: torch.Tensor,
    entropy: torch.Tensor | None = None,
    *,
    tensor_metrics: bool = False,
) -> tuple[torch.Tensor, dict]:
    """:func:`objective_loss` of one packed micro-batch, as every backend computes it from
    its per-token ``log_probs`` ``[N]`` (and ``entropy`` ``[N]``): the batch's mask,
    advantages and reference log-probs over the step's global denominators; in "policy"
    mode the old log-probs and rollout importance weights of :func:`policy_inputs`, whose
    metrics join the loss's."""
    old, weights, metrics = (
        policy_inputs(objective, batch, log_probs, tensor_metrics=tensor_metrics)
        if objective.mode == "policy"
        else (None, None, {})
    )
    loss, loss_metrics = objective_loss(
        objective,
        log_probs=log_probs,
        mask=batch.loss_mask,
        old_log_probs=old,
        advantages=batch.advantages,
        entropy=entropy,
        ref_log_probs=batch.ref_log_probs,
        importance_weights=weights,
        num_tokens=batch.global_num_tokens,
        num_seqs=batch.global_num_seqs,
        cu_seqlens=batch.cu_seqlens,
        tensor_metrics=tensor_metrics,
    )
    return loss, metrics | loss_metrics


def objective_loss(
    objective: Objective,
    *,
    log_probs: torch.Tensor,
    mask: torch.Tensor,
    old_log_probs: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    tensor_metrics: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss ``objective`` describes: :func:`sft_objective` in "sft" mode,
    :func:`rl_core.preference.packed_pair_loss` in "dpo" mode (packed pairs, needs
    ``ref_log_probs``, ``cu_seqlens`` and ``num_seqs`` = twice the step's pairs), else
    :func:`policy_objective` with every term of the objective (shapes and metrics as
    there; ``old_log_probs`` and ``advantages`` are required in "policy" mode)."""
    aggregation = {
        "agg_mode": objective.loss_agg_mode,
        "norm_length": objective.norm_length,
        "num_tokens": num_tokens,
        "num_seqs": num_seqs,
        "cu_seqlens": cu_seqlens,
        "tensor_metrics": tensor_metrics,
    }
    if objective.mode == "sft":
        return sft_objective(log_probs=log_probs, mask=mask, **aggregation)
    if objective.mode == "dpo":
        return dpo_objective(
            objective,
            log_probs=log_probs,
            mask=mask,
            ref_log_probs=ref_log_probs,
            cu_seqlens=cu_seqlens,
            num_seqs=num_seqs,
            tensor_metrics=tensor_metrics,
        )
    if old_log_probs is None or advantages is None:
        raise ValueError("mode='policy' needs old_log_probs and advantages (or use mode='sft')")
    return policy_objective(
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=advantages,
        mask=mask,
        loss_name=objective.policy_loss,
        clip_low=objective.clip_low,
        clip_high=objective.clip_high,
        dual_clip=objective.dual_clip,
        entropy=entropy,
        entropy_coef=objective.entropy_coef,
        ref_log_probs=ref_log_probs,
        kl_coef=objective.kl_coef,
        kl_kind=objective.kl_kind,
        unbiased_kl=objective.unbiased_kl,
        opsm_delta=objective.opsm_delta if objective.opsm else None,
        importance_weights=importance_weights,
        **aggregation,
    )


def dpo_objective(
    objective: Objective,
    *,
    log_probs,
    mask,
    ref_log_probs,
    cu_seqlens,
    num_seqs,
    tensor_metrics=False,
):
    """The "dpo" mode's loss; its inputs checked, the rest in ``packed_pair_loss``."""
    if ref_log_probs is None or cu_seqlens is None or num_seqs is None:
        raise ValueError("mode='dpo' needs ref_log_probs, cu_seqlens and num_seqs (2 x pairs)")
    loss, metrics = packed_pair_loss(
        log_probs=log_probs,
        ref_log_probs=ref_log_probs,
        mask=mask,
        cu_seqlens=cu_seqlens,
        num_pairs=float(num_seqs) / 2,
        beta=objective.dpo_beta,
        kind=objective.dpo_loss,
        label_smoothing=objective.dpo_label_smoothing,
        tensor_metrics=tensor_metrics,
    )
    return loss, metrics | {"loss/total": metrics["pref/loss"]}


def policy_objective(
    *,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    loss_name: str = "ppo",
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "low_var_kl",
    unbiased_kl: bool = False,
    opsm_delta: float | None = None,
    importance_weights: torch.Tensor | None = None,
    agg_mode: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    norm_length: float | None = None,
    tensor_metrics: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss = agg(pg · w) + kl_coef · agg(kl) - entropy_coef · agg(entropy).

    ``agg`` is :func:`rl_core.aggregation.aggregate` with ``agg_mode`` and the denominators;
    the metric ``pg/clipfrac`` is always the fraction of valid tokens clipped (token-mean
    over ``num_tokens``, as verl reports it), whatever ``agg_mode`` the loss uses.

    Shapes: every per-token tensor ``[B, T]`` (or packed ``[N]`` with ``cu_seqlens``).
    ``importance_weights`` (e.g. from :func:`rl_core.importance.rollout_importance_weights`)
    multiply the per-token policy loss. ``unbiased_kl`` weights the KL term by pi / pi_old
    (:func:`rl_core.kl.importance_weighted_kl`); ``opsm_delta`` (None = off) drops the
    policy loss of off-policy sequences with negative advantages
    (:func:`rl_core.importance.off_policy_sequence_mask`; metric ``pg/opsm_frac``, the
    share of valid tokens dropped). Returns ``(loss, metrics)``; metrics are Python
    floats, or detached 0-d tensors with ``tensor_metrics`` (no device read-back: a
    trainer sums them over micro-batches and reads them once per step).
    """
    value = _detached if tensor_metrics else _as_float
    policy_loss_fn = POLICY_LOSSES.get(loss_name)
    pg_loss, clipfrac = policy_loss_fn(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        cu_seqlens=cu_seqlens,
    )
    if importance_weights is not None:
        pg_loss = pg_loss * importance_weights
    opsm_dropped = None
    if opsm_delta is not None:
        keep, opsm_dropped = off_policy_sequence_mask(
            log_probs, old_log_probs, advantages, mask, delta=opsm_delta, cu_seqlens=cu_seqlens
        )
        pg_loss = pg_loss * keep

    def agg(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate(
            per_token,
            mask,
            mode=agg_mode,
            cu_seqlens=cu_seqlens,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            norm_length=norm_length,
        )

    loss = agg(pg_loss)
    clipped_tokens = aggregate(clipfrac, mask, cu_seqlens=cu_seqlens, num_tokens=num_tokens)
    metrics = {"loss/pg": value(loss), "pg/clipfrac": value(clipped_tokens)}
    if opsm_dropped is not None:
        dropped = aggregate(opsm_dropped, mask, cu_seqlens=cu_seqlens, num_tokens=num_tokens)
        metrics["pg/opsm_frac"] = value(dropped)
    if ref_log_probs is not None and kl_coef != 0.0:
        if unbiased_kl:
            per_token_kl = importance_weighted_kl(
                log_probs, old_log_probs, ref_log_probs, kind=kl_kind
            )
        else:
            per_token_kl = approx_kl(log_probs, ref_log_probs, kind=kl_kind)
        kl_term = agg(per_token_kl)
        loss = loss + kl_coef * kl_term
        metrics["loss/kl"] = value(kl_term)
    if entropy is not None:
        entropy_term = agg(entropy)
        if entropy_coef != 0.0:
            loss = loss + entropy_coef * agg(entropy_loss(entropy))
        metrics["actor/entropy"] = value(entropy_term)
    metrics["loss/total"] = value(loss)
    return loss, metrics


def _as_float(tensor: torch.Tensor) -> float:
    return float(tensor.detach())


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach()


def sft_objective(
    *,
    log_probs: torch.Tensor,
    mask: torch.Tensor,
    agg_mode: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    norm_length: float | None = None,
    tensor_metrics: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Supervised fine-tuning: aggregated negative log-likelihood of the masked tokens
    (metrics as in :func:`policy_objective`)."""
    loss = aggregate(
        sft_loss(log_probs),
        mask,
        mode=agg_mode,
        cu_seqlens=cu_seqlens,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_length=norm_length,
    )
    value = _detached(loss) if tensor_metrics else _as_float(loss)
    return loss, {"loss/sft": value, "loss/total": value}
