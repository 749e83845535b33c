"""The optimizers build_optimizer makes, checked against their update rule by hand."""

import pytest
import torch
from fsdp_tiny import CONFIGS, padded_logits, plain_model, tokens_batch

from rl_fsdp import FSDPConfig
from rl_fsdp.faults import guarded_step
from rl_fsdp.optim import build_optimizer

MODEL = {"model_config": CONFIGS["qwen2"]}


def stepped(config: FSDPConfig, flag: float = 0.0):
    """A tiny model's parameters and gradients before one (guarded) step, and after it."""
    model = plain_model(CONFIGS["qwen2"])
    optimizer, _ = build_optimizer(model, config)
    batch = tokens_batch()
    padded_logits(model, batch).logsumexp(-1).mean().backward()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    guarded_step(optimizer, torch.tensor(flag))
    return before, grads, dict(model.named_parameters())


def test_an_sgd_step_is_w_minus_lr_grad():
    before, grads, after = stepped(FSDPConfig(**MODEL, optimizer="sgd", lr=0.5))
    assert sum(g.abs().sum() for g in grads.values()) > 0
    for name, param in after.items():
        torch.testing.assert_close(param.detach(), before[name] - 0.5 * grads[name])


def test_sgd_weight_decay_shrinks_w_by_lr_times_decay():
    config = FSDPConfig(**MODEL, optimizer="sgd", lr=0.5, weight_decay=0.1)
    before, grads, after = stepped(config)
    for name, param in after.items():
        expected = before[name] * (1 - 0.5 * 0.1) - 0.5 * grads[name]
        torch.testing.assert_close(param.detach(), expected)


def test_a_nonfinite_flag_skips_the_sgd_step():
    before, _, after = stepped(FSDPConfig(**MODEL, optimizer="sgd", lr=0.5), flag=1.0)
    for name, param in after.items():
        torch.testing.assert_close(param.detach(), before[name], rtol=0, atol=0)


def test_adamw_stays_the_default():
    model = plain_model(CONFIGS["qwen2"])
    optimizer, _ = build_optimizer(model, FSDPConfig(**MODEL))
    assert type(optimizer) is torch.optim.AdamW


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"optimizer": "lion"}, "optimizer"),
        ({"optimizer": "sgd", "momentum": 1.0}, "momentum"),
        ({"momentum": 0.9}, "momentum"),  # AdamW has no momentum to set
    ],
)
def test_bad_optimizer_fields_are_refused(fields, named):
    with pytest.raises(ValueError, match=named):
        FSDPConfig(**MODEL, **fields)
