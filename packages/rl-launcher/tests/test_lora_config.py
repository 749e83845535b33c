"""model.lora_*: mapped onto rl-fsdp's LoRASpec for the actor (off by default), refused
before Ray starts where no adapters exist (megatron) or none would be added."""

import pytest

from rl_fsdp.lora import DEFAULT_TARGETS, LoRASpec
from rl_launcher.config.loader import load_config
from rl_launcher.config.schema import LORA_TARGETS
from rl_launcher.roles.backends import fsdp_config


def test_lora_settings_reach_the_fsdp_config(tmp_path):
    config, _ = load_config([])
    assert fsdp_config(config, model_dir=tmp_path).lora is None  # full fine-tuning
    config, _ = load_config(
        [
            "model.lora_rank=8",
            "model.lora_alpha=32",
            "model.lora_targets=[q_proj, v_proj]",
            "mode=sft",
        ]
    )
    spec = fsdp_config(config, model_dir=tmp_path).lora
    assert spec == LoRASpec(rank=8, alpha=32.0, dropout=0.0, targets=("q_proj", "v_proj"))
    assert spec.scaling == 4.0
    assert LORA_TARGETS == DEFAULT_TARGETS  # the schema's default is rl-fsdp's


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["model.lora_rank=8", "backend.name=megatron"], r"backend\.name=fsdp only.*lora_rank=0"),
        (["model.lora_rank=8", "model.lora_targets=[]"], r"lora_targets is empty.*q_proj"),
        (["model.lora_dropout=1.0"], r"model\.lora_dropout"),
    ],
)
def test_bad_lora_settings_are_refused_before_anything_starts(args, message):
    with pytest.raises(ValueError, match=message):
        load_config(args)
