"""Gradient reduction, norm and clipping for a tensor/data-parallel GPTModel shard.

Losses use global denominators, so every rank's gradient is its share of the full-batch
gradient: data-parallel ranks SUM their gradients. TP-sharded parameters (megatron marks
them ``tensor_model_parallel``) contribute their shard to the global norm; replicated ones
(norms, value head) are identical on every TP rank and count once.
"""

import contextlib

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from rl_core.lr_schedule import lr_multiplier
from rl_megatron.precision import grad_of, make_mixed


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sum gradients (fp32 main grads where present) over ``group``, one flat buffer per
    dtype."""
    if _world(group) == 1:
        return
    grads = [g for g in map(grad_of, params) if g is not None]
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        for grad, reduced in zip(same, _unflatten_dense_tensors(flat, same), strict=True):
            grad.copy_(reduced)


def tp_partial_params(model) -> list[torch.nn.Parameter]:
    """Replicated parameters whose gradient each TP rank holds only a part of, to be summed
    over TP: norms under sequence parallel (each rank saw part of the sequence) and the
    per-head q/k norms (each rank saw its own heads)."""
    return [
        p
        for name, p in model.named_parameters()
        if getattr(p, "sequence_parallel", False) or _per_head_norm(name, p)
    ]


def _per_head_norm(name: str, param) -> bool:
    """A q/k norm over heads split across TP ranks (not MLA's whole query-latent norm)."""
    per_head = "q_layernorm" in name or "k_layernorm" in name
    return per_head and not getattr(param, "whole_on_every_tp_rank", False)


def global_grad_norm(
    params: list[torch.nn.Parameter],
    tp_group,
    *,
    expert_params=(),
    expert_groups=(),
    stage_group=None,
) -> float:
    """L2 norm of the full model's gradient: TP shards summed over ``tp_group``, expert
    weights over each of ``expert_groups`` (expert-TP, EP), replicas counted once."""
    with_grad = [p for p in params if grad_of(p) is not None]
    device = grad_of(with_grad[0]).device if with_grad else torch.device("cpu")
    if not with_grad and stage_group is None:
        return 0.0
    expert_ids = {id(p) for p in expert_params}
    # [0]: TP-sharded dense, [1]: replicated, [2]: expert weights
    if with_grad:
        squares = _squares_by_slot(with_grad, expert_ids)
    else:  # a pipeline stage without gradients still joins the stages' sum
        squares = torch.zeros(3, dtype=torch.float64, device=device)
    squares[0] = _summed(squares[0], [tp_group])
    squares[2] = _summed(squares[2], expert_groups)
    if stage_group is not None and _world(stage_group) > 1:  # pipeline stages: disjoint
        dist.all_reduce(squares, group=stage_group)
    return float(squares.sum().sqrt())


def _squares_by_slot(params, expert_ids: set[int]) -> torch.Tensor:
    """Float64 ``[3]``: the summed squared gradient norms of each slot's parameters. One
    fused norm kernel over all of them, ordered by slot so that each slot's norms are a
    slice: no per-step index tensor copied from the host, no cast per parameter."""
    slots = [_slot(p, expert_ids) for p in params]
    order = sorted(range(len(params)), key=slots.__getitem__)
    norms = torch._foreach_norm([grad_of(params[i]).detach() for i in order])
    per_param = torch.stack(norms).to(torch.float64).square()
    sizes = [slots.count(slot) for slot in range(3)]
    return torch.stack([part.sum() for part in per_param.split(sizes)])


def _slot(param, expert_ids: set[int]) -> int:
    if id(param) in expert_ids:
        return 2
    return 0 if getattr(param, "tensor_model_parallel", False) else 1


def _summed(value: torch.Tensor, groups) -> torch.Tensor:
    value = value.reshape(1).clone()
    for group in groups:
        if _world(group) > 1:
            dist.all_reduce(value, group=group)
    return value[0]


def clip_grads(params: list[torch.nn.Parameter], *, max_norm: float, norm: float) -> None:
    """Scale gradients by ``max_norm / norm`` when the norm exceeds ``max_norm`` (0: off)."""
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        grads = [g for g in map(grad_of, params) if g is not None]
        if grads:
            torch._foreach_mul_(grads, scale)


@contextlib.contextmanager
def clipped(optimizer, params: list[torch.nn.Parameter], *, max_norm: float, norm: float):
    """Clip to ``max_norm`` for the ``optimizer.step()`` run inside. A fused AdamW divides
    the gradients by the clip factor in its own kernel (its AMP ``grad_scale`` input), which
    saves a read and a write of every fp32 gradient; other optimizers get
    :func:`clip_grads` first."""
    local = local_optimizer(optimizer)
    stepped = [t for group in local.param_groups for t in group["params"]]
    fused = stepped and all(group.get("fused") for group in local.param_groups)
    if not (max_norm > 0 and norm > max_norm) or not fused:
        clip_grads(params, max_norm=max_norm, norm=norm)
        yield
        return
    local.grad_scale = _grad_scale_buffer(local, stepped[0].device).fill_((norm + 1e-6) / max_norm)
    try:
        yield
    finally:
        del local.grad_scale


def _grad_scale_buffer(optimizer, device: torch.device) -> torch.Tensor:
    """The optimizer's float32 scalar for the fused kernel's ``grad_scale``, made once and
    refilled each step (a fill kernel, not a copy from pageable host memory)."""
    buffer = getattr(optimizer, "_grad_scale_buffer", None)
    if buffer is None or buffer.device != device:
        buffer = torch.empty((), dtype=torch.float32, device=device)
        optimizer._grad_scale_buffer = buffer
    return buffer


def make_optimizer(params, config, layout, dp_group):
    """AdamW; ZeRO-1 over the data-parallel group when dp > 1 (each rank keeps 1/dp of the
    state). Not with expert parallelism: expert weights differ between DP ranks there.
    With ``config.precision == "bf16"`` it steps fp32 master weights
    (:class:`rl_megatron.precision.MasterWeightsOptimizer`)."""
    return make_mixed(
        params, lambda tensors: _adamw(tensors, config, layout, dp_group), config.precision
    )


def _adamw(params, config, layout, dp_group) -> torch.optim.Optimizer:
    kwargs = dict(
        lr=config.lr, betas=config.adam_betas, eps=config.adam_eps, weight_decay=config.weight_decay
    )
    if config.device == "cuda":
        kwargs["fused"] = True  # one kernel for the whole update
    if config.distributed_optimizer and layout.dp_size > 1 and layout.ep_size == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.AdamW, process_group=dp_group, **kwargs
        )
    return torch.optim.AdamW(params, **kwargs)


def set_lr(optimizer, config, step: int) -> float:
    """Set the lr of optimizer step ``step`` (0-based) on every wrapper level's param
    groups (ZeRO copies its own groups into the inner optimizer's) and return it."""
    lr = config.lr * lr_multiplier(
        step,
        warmup_steps=config.warmup_steps,
        decay=config.lr_decay,
        total_steps=config.total_steps,
        min_lr_ratio=config.min_lr_ratio,
    )
    while True:
        for group in optimizer.param_groups:
            group["lr"] = lr
        if not hasattr(optimizer, "optim"):
            return lr
        optimizer = optimizer.optim


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state (inside the master-weights and ZeRO wrappers)."""
    while hasattr(optimizer, "optim"):
        optimizer = optimizer.optim
    return optimizer


def move_training_state(params, optimizer, device: torch.device) -> None:
    """Parameters, gradients and this rank's optimizer state to ``device``."""
    for param in params:
        param.data = param.data.to(device, non_blocking=True)
        if param.grad is not None:
            param.grad = param.grad.to(device, non_blocking=True)
    if hasattr(optimizer, "move_to"):  # fp32 masters and main grads
        optimizer.move_to(device)
    for state in local_optimizer(optimizer).state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
