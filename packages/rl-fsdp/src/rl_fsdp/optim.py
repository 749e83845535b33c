"""AdamW or SGD, and the learning-rate schedule: linear warmup, then constant, linear or cosine
decay to ``min_lr_ratio · lr`` at ``total_steps``."""

import torch
from torch import nn

from rl_core.lr_schedule import lr_multiplier as schedule_multiplier
from rl_fsdp.config import FSDPConfig


def lr_multiplier(step: int, config: FSDPConfig) -> float:
    """Factor on ``config.lr`` for optimizer step ``step`` (0-based;
    :func:`rl_core.lr_schedule.lr_multiplier`, the schedule rl-megatron steps by too)."""
    return schedule_multiplier(
        step,
        warmup_steps=config.warmup_steps,
        decay=config.lr_decay,
        total_steps=config.total_steps,
        min_lr_ratio=config.min_lr_ratio,
    )


def build_optimizer(model: nn.Module, config: FSDPConfig):
    """``config.optimizer`` (AdamW or SGD) over the trainable parameters and a LambdaLR
    with :func:`lr_multiplier`. Fused on CPU and GPU alike: its kernel can skip a
    non-finite step on the device (:func:`rl_fsdp.faults.guarded_step`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(params, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, config)
    )
    return optimizer, scheduler


def _optimizer(params: list[nn.Parameter], config: FSDPConfig) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":  # weight decay added to the gradient (see FSDPConfig)
        return torch.optim.SGD(
            params,
            lr=config.lr,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
            fused=True,
        )
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=True,
    )
