"""Advantage and return estimators.

Shapes: scalar rewards are ``[B]`` with each prompt's group of samples contiguous
(``B = num_prompts · group_size``, or ``sum(group_sizes)`` when groups differ in size, e.g.
once samples whose reward failed are left out); per-token tensors are padded ``[B, T]``
with a ``mask`` (1 on response tokens that are trained). Masked positions of every
per-token output are 0. Nothing here whitens unless asked (:func:`whiten`). Outputs are
float32, or float64 when the inputs are (nothing narrows a float64 input).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rl_core import names
from rl_core._dtype import wide
from rl_core.registry import Registry


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B]`` -> ``[B / group_size, group_size]``, refusing a ragged batch."""
    if rewards.dim() != 1:
        raise ValueError(f"scalar rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size} "
            "(samples of one prompt must be contiguous and complete)"
        )
    return wide(rewards).view(-1, group_size)


def _ragged(rewards: torch.Tensor, group_sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B]`` rewards in contiguous groups of ``group_sizes`` -> (group of each sample
    ``[B]``, float size of each group ``[G]``), refusing sizes that do not add up to B."""
    if rewards.dim() != 1:
        raise ValueError(f"scalar rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    sizes = torch.as_tensor(list(group_sizes), dtype=torch.long, device=rewards.device)
    if sizes.numel() == 0 or int(sizes.min()) < 1 or int(sizes.sum()) != rewards.numel():
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of sizes {list(group_sizes)} "
            "(samples of one prompt must be contiguous; every group needs a sample)"
        )
    ids = torch.repeat_interleave(torch.arange(sizes.numel(), device=rewards.device), sizes)
    return ids, sizes.to(wide(rewards).dtype)


def _group_sum(values: torch.Tensor, ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[G]`` sums of ``values`` ``[B]`` over the samples of each group."""
    return values.new_zeros(num_groups).index_add_(0, ids, values)


def group_normalize(
    rewards: torch.Tensor,
    *,
    group_size: int,
    std: bool = True,
    eps: float = 1e-6,
    group_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """GRPO advantages: (r - group mean) / (group std + eps), std unbiased.

    ``std=False`` only subtracts the mean (Dr.GRPO). A group of one has zero advantage.
    ``group_sizes``: the size of each contiguous group when they differ (``group_size`` is
    then ignored). Returns ``[B]``.
    """
    if group_sizes is not None:
        return _ragged_normalize(rewards, group_sizes, std=std, eps=eps)
    groups = _grouped(rewards, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if std:
        group_std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(groups)
        centred = centred / (group_std + eps)
    return centred.reshape(-1)


def _ragged_normalize(
    rewards: torch.Tensor, group_sizes: Sequence[int], *, std: bool, eps: float
) -> torch.Tensor:
    """:func:`group_normalize` over groups of different sizes."""
    ids, sizes = _ragged(rewards, group_sizes)
    values = wide(rewards)
    centred = values - (_group_sum(values, ids, sizes.numel()) / sizes)[ids]
    if std:
        variance = _group_sum(centred.square(), ids, sizes.numel()) / (sizes - 1).clamp(min=1)
        group_std = torch.where(sizes > 1, variance.sqrt(), torch.zeros_like(variance))
        centred = centred / (group_std[ids] + eps)
    return centred


def rloo(
    rewards: torch.Tensor, *, group_size: int, group_sizes: Sequence[int] | None = None
) -> torch.Tensor:
    """Leave-one-out baseline: r_i - mean of the other samples of the group. Returns ``[B]``.
    ``group_sizes`` as in :func:`group_normalize` (each at least 2)."""
    if group_sizes is not None:
        ids, sizes = _ragged(rewards, group_sizes)
        if int(sizes.min()) < 2:
            raise ValueError(f"rloo needs groups of >= 2 samples, got sizes {list(group_sizes)}")
        values = wide(rewards)
        sums = _group_sum(values, ids, sizes.numel())[ids]
        return values - (sums - values) / (sizes[ids] - 1)
    if group_size < 2:
        raise ValueError("rloo needs group_size >= 2 (the baseline is the other samples)")
    groups = _grouped(rewards, group_size)
    others_mean = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others_mean).reshape(-1)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma · G_(next valid t), computed right to left over valid tokens.

    ``rewards``, ``mask``: ``[B, T]``. Masked positions are skipped (a masked tool output
    between two turns neither adds reward nor discounts). Returns ``[B, T]``.
    """
    rewards = wide(rewards)
    weights = mask.to(rewards.dtype)
    rewards = rewards * weights
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        valid = weights[:, t]
        running = valid * (rewards[:, t] + gamma * running) + (1.0 - valid) * running
        returns[:, t] = running
    return returns * weights


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over valid tokens, not whitened.

    delta_t = r_t + gamma·V_(next valid) - V_t; A_t = delta_t + gamma·lam·A_(next valid);
    the value after a row's last valid token is 0. ``rewards``, ``values``, ``mask``:
    ``[B, T]``. Returns ``(advantages, returns)`` each ``[B, T]``, returns = A + V.
    """
    dtype = torch.promote_types(wide(rewards).dtype, wide(values).dtype)
    weights = mask.to(dtype)
    rewards, values = rewards.to(dtype) * weights, values.to(dtype) * weights
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    next_advantage = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        valid = weights[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_advantage = valid * advantage + (1.0 - valid) * next_advantage
        next_value = valid * values[:, t] + (1.0 - valid) * next_value
        advantages[:, t] = advantage
    advantages = advantages * weights
    return advantages, (advantages + values) * weights


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each row's scalar reward on its last valid token: ``[B]`` -> ``[B, T]``."""
    rewards = wide(rewards)
    weights = mask.to(rewards.dtype)
    positions = torch.arange(weights.shape[1], device=weights.device).expand_as(weights)
    last = torch.where(weights > 0, positions, -1).max(dim=1).values
    token_rewards = torch.zeros_like(weights)
    has_token = last >= 0
    rows = torch.nonzero(has_token).squeeze(-1)
    token_rewards[rows, last[has_token]] = rewards[has_token]
    return token_rewards


def reinforce_pp_returns(
    rewards: torch.Tensor,
    *,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++ returns: token rewards -kl_coef·kl, plus the scalar reward on each row's
    last valid token, discounted with ``gamma``. ``rewards`` ``[B]``; ``kl``, ``mask``
    ``[B, T]``. Returns ``[B, T]`` (whiten them over the batch to get advantages).
    """
    token_rewards = -kl_coef * wide(kl) * mask + last_token_rewards(rewards, mask)
    return discounted_returns(token_rewards, mask, gamma=gamma)


def reinforce_pp_baseline(
    rewards: torch.Tensor,
    *,
    group_size: int,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    group_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """REINFORCE++-baseline: (r - group mean) on every token, minus kl_coef·kl.

    ``rewards`` ``[B]``; ``kl``, ``mask`` ``[B, T]``; ``group_sizes`` as in
    :func:`group_normalize`. Returns ``[B, T]`` (not whitened).
    """
    centred = group_normalize(rewards, group_size=group_size, std=False, group_sizes=group_sizes)
    return (centred.unsqueeze(-1) - kl_coef * wide(kl)) * mask


def whiten(values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True) -> torch.Tensor:
    """(v - masked mean) / sqrt(unbiased masked variance + 1e-8), over all valid tokens.

    With ``shift_mean=False`` the mean is added back (scale only). Masked positions are 0.
    """
    values = wide(values)
    weights = mask.to(values.dtype)
    count = weights.sum()
    mean = (values * weights).sum() / count.clamp(min=1.0)
    variance = ((values - mean).square() * weights).sum() / (count - 1.0).clamp(min=1.0)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * weights


@dataclass(frozen=True, kw_only=True)
class AdvantageInputs:
    """Everything an estimator may read; each uses what it needs.

    rewards: ``[B]`` scalar rewards, groups contiguous. mask: ``[B, T]`` response tokens.
    values: ``[B, T]`` critic values (GAE). kl: ``[B, T]`` per-token KL to the reference.
    group_sizes: the size of each group when they differ (None: all ``group_size``).
    whiten: whiten the advantages over all valid tokens (:func:`whiten`): None = the
    estimator's own choice (reinforce_plus_plus, reinforce_plus_plus_baseline and gae
    whiten; grpo, dr_grpo and rloo do not), True = always (slime's
    ``--normalize-advantages``), False = never. Returns are never whitened.
    """

    rewards: torch.Tensor
    mask: torch.Tensor
    group_size: int = 1
    group_sizes: tuple[int, ...] | None = None
    values: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    gamma: float = 1.0
    lam: float = 1.0
    kl_coef: float = 0.0
    whiten: bool | None = None


# fn(inputs) -> (advantages [B, T], returns [B, T])
AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]
# by name, torch-free in rl_core.names (a config's estimator is checked without torch)
ADVANTAGE_SHAPE = names.ADVANTAGE_SHAPE
ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = names.ADVANTAGE_ESTIMATORS
# The built-in estimators that whiten when AdvantageInputs.whiten is None (a caller that adds
# to the advantages before whitening, as on-policy distillation does, asks with whiten=False
# and whitens the sum itself; tests/test_advantages.py checks this against the estimators).
WHITENED_BY_DEFAULT = frozenset({"reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"})


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_seq.unsqueeze(-1) * mask.to(per_seq.dtype)


def _finish(advantages: torch.Tensor, inputs: AdvantageInputs, *, by_default: bool):
    """``advantages`` whitened when ``inputs.whiten`` says so (None: ``by_default``)."""
    wanted = by_default if inputs.whiten is None else inputs.whiten
    return whiten(advantages, inputs.mask) if wanted else advantages


@ADVANTAGE_ESTIMATORS.register("grpo")
def _grpo(inputs: AdvantageInputs):
    normalized = group_normalize(
        inputs.rewards, group_size=inputs.group_size, group_sizes=inputs.group_sizes
    )
    adv = _broadcast(normalized, inputs.mask)
    return _finish(adv, inputs, by_default=False), adv


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def _dr_grpo(inputs: AdvantageInputs):
    centred = group_normalize(
        inputs.rewards, group_size=inputs.group_size, std=False, group_sizes=inputs.group_sizes
    )
    adv = _broadcast(centred, inputs.mask)
    return _finish(adv, inputs, by_default=False), adv


@ADVANTAGE_ESTIMATORS.register("rloo")
def _rloo(inputs: AdvantageInputs):
    baseline = rloo(inputs.rewards, group_size=inputs.group_size, group_sizes=inputs.group_sizes)
    adv = _broadcast(baseline, inputs.mask)
    return _finish(adv, inputs, by_default=False), adv


def _kl_or_zero(inputs: AdvantageInputs) -> torch.Tensor:
    if inputs.kl is not None:
        return inputs.kl
    return torch.zeros_like(inputs.mask, dtype=wide(inputs.rewards).dtype)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def _reinforce_pp(inputs: AdvantageInputs):
    returns = reinforce_pp_returns(
        inputs.rewards,
        kl=_kl_or_zero(inputs),
        mask=inputs.mask,
        kl_coef=inputs.kl_coef,
        gamma=inputs.gamma,
    )
    return _finish(returns, inputs, by_default=True), returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
def _reinforce_pp_baseline(inputs: AdvantageInputs):
    adv = reinforce_pp_baseline(
        inputs.rewards,
        group_size=inputs.group_size,
        kl=_kl_or_zero(inputs),
        mask=inputs.mask,
        kl_coef=inputs.kl_coef,
        group_sizes=inputs.group_sizes,
    )
    return _finish(adv, inputs, by_default=True), adv


@ADVANTAGE_ESTIMATORS.register("gae")
def _gae(inputs: AdvantageInputs):
    if inputs.values is None:
        raise ValueError("the 'gae' estimator needs critic values (PPO with a critic)")
    token_rewards = last_token_rewards(inputs.rewards, inputs.mask)
    token_rewards = token_rewards - inputs.kl_coef * _kl_or_zero(inputs) * inputs.mask
    adv, returns = gae(
        token_rewards, inputs.values, inputs.mask, gamma=inputs.gamma, lam=inputs.lam
    )
    return _finish(adv, inputs, by_default=True), returns
