"""FSDPConfig validation and the learning-rate schedule, by hand."""

import math

import pytest
from fsdp_tiny import CONFIGS

from rl_fsdp import FSDPConfig
from rl_fsdp.optim import lr_multiplier

MODEL = {"model_config": CONFIGS["qwen2"]}


@pytest.mark.parametrize(
    ("fields", "field_named"),
    [
        ({}, "model_path"),
        ({**MODEL, "model_path": "/x"}, "model_path"),
        ({"model_config": {"hidden_size": 8}}, "model_type"),
        ({**MODEL, "precision": "fp16"}, "precision"),
        ({**MODEL, "attention": "eager"}, "attention"),
        ({**MODEL, "lr": 0.0}, "lr"),
        ({**MODEL, "max_tokens_per_micro_batch": 0}, "max_tokens_per_micro_batch"),
        ({**MODEL, "lr_decay": "cosine"}, "total_steps"),
        ({**MODEL, "min_lr_ratio": 2.0}, "min_lr_ratio"),
        ({**MODEL, "max_grad_norm": -1.0}, "max_grad_norm"),
        ({**MODEL, "objective": {"policy_loss": "ppo"}}, "objective"),
        ({**MODEL, "ref_offload": True}, "reference"),
        ({**MODEL, "compile_layers": True, "activation_checkpointing": True}, "checkpointing"),
    ],
)
def test_bad_fields_raise_naming_the_field(fields, field_named):
    with pytest.raises(ValueError, match=field_named):
        FSDPConfig(**fields)


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        FSDPConfig("/some/dir")  # type: ignore[misc]


def test_defaults_are_valid():
    config = FSDPConfig(**MODEL)
    assert config.micro_batch_tokens_for_log_probs == 8192
    assert FSDPConfig(**MODEL, log_prob_max_tokens=100).micro_batch_tokens_for_log_probs == 100


def _lr(decay, **kw):
    config = FSDPConfig(**MODEL, lr_decay=decay, warmup_steps=2, total_steps=6, **kw)
    return [lr_multiplier(step, config) for step in range(8)]


def test_warmup_then_constant():
    assert _lr("constant") == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_warmup_then_linear_to_min():
    assert _lr("linear", min_lr_ratio=0.2) == pytest.approx(
        [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    )


def test_warmup_then_cosine():
    c = 0.5 * (1 + math.cos(math.pi / 4))
    assert _lr("cosine") == pytest.approx([0.5, 1.0, 1.0, c, 0.5, 1 - c, 0.0, 0.0])
