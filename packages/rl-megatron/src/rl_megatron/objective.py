"""The loss of one micro-batch from the backend's per-token outputs, all maths from rl_core:
the config's :class:`rl_core.objective.Objective` through ``batch_objective_loss``.

Every loss is aggregated with the step's global denominators carried by the batch, so
summing micro-batches and ranks gives the full-batch loss.
"""

import torch

from rl_core.batch import TrainBatch
from rl_core.losses import value_loss
from rl_core.objective import aggregate_batch, batch_objective_loss
from rl_megatron.config import MegatronConfig


def actor_loss(
    config: MegatronConfig,
    part: TrainBatch,
    log_probs: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    tensor_metrics: bool = False,
) -> tuple[torch.Tensor, dict]:
    """SFT or policy loss of ``part`` from its log-probs ``[N]`` (and entropy ``[N]``);
    metrics as floats, or with ``tensor_metrics`` as 0-d device tensors (no host sync)."""
    return batch_objective_loss(
        config.objective, part, log_probs, entropy, tensor_metrics=tensor_metrics
    )


def critic_loss(
    config: MegatronConfig, part: TrainBatch, values: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss of ``part`` from its values ``[N]``."""
    if part.returns is None:
        raise ValueError("critic training needs batch.returns (and old_values to clip)")
    old = part.old_values if part.old_values is not None else values.detach()
    per_token, clipped = value_loss(values, old, part.returns, clip=config.value_clip)
    loss = aggregate_batch(config.objective, per_token, part)
    clipfrac = aggregate_batch(config.objective, clipped, part)
    metrics = {"loss/value": float(loss.detach()), "critic/clipfrac": float(clipfrac)}
    return loss, {**metrics, "loss/total": metrics["loss/value"]}
