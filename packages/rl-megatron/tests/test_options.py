"""megatron-core options by name (``MegatronConfig.megatron``): checked against
megatron-core's dataclasses, routed to the model's TransformerConfig or to this backend."""

import pytest

from rl_megatron.config import MegatronConfig
from rl_megatron.models import transformer_config
from rl_megatron.options import split_options
from rl_megatron.weights import hf_config_of


def test_transformer_fields_reach_the_model_config(model_dirs):
    path = model_dirs["qwen3"][0]
    options = {"recompute_granularity": "full", "recompute_method": "block"}
    options |= {"recompute_num_layers": 1, "attention_dropout": 0.1}
    config = MegatronConfig(hf_path=path, megatron=options)
    built = transformer_config(hf_config_of(path), options=config.megatron_options().transformer)
    assert (built.recompute_granularity, built.recompute_method) == ("full", "block")
    assert (built.recompute_num_layers, built.attention_dropout) == (1, 0.1)
    assert built.calculate_per_token_loss  # the backend's own fields are kept


def test_use_distributed_optimizer_sets_the_backend_field(model_dirs):
    path = model_dirs["qwen3"][0]
    assert MegatronConfig(hf_path=path).distributed_optimizer is True
    config = MegatronConfig(hf_path=path, megatron={"use_distributed_optimizer": False})
    assert config.distributed_optimizer is False
    assert config.megatron_options().transformer == {}


def test_unknown_names_get_the_closest_field_and_its_dataclass():
    with pytest.raises(
        ValueError,
        match=r"'recompute_granulariti' is not a field .* did you mean "
        r"'recompute_granularity' \(TransformerConfig\)",
    ):
        split_options({"recompute_granulariti": "full"})
    with pytest.raises(
        ValueError, match=r"'overlap_grad_reduc'.*\(DistributedDataParallelConfig\)"
    ):
        split_options({"overlap_grad_reduc": True})


def test_fields_the_backend_sets_are_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size is set by rl-megatron; use "):
        split_options({"tensor_model_parallel_size": 2})
    with pytest.raises(ValueError, match=r"TransformerConfig.tensor_model_parallel_size .* use tp"):
        split_options({"tensor_model_parallel_size": 2}, owners={"tp": "tp"})
    with pytest.raises(ValueError, match=r"num_layers comes from the model's HF config"):
        split_options({"num_layers": 4})
    with pytest.raises(ValueError, match=r"calculate_per_token_loss is fixed by rl-megatron"):
        split_options({"calculate_per_token_loss": False})
    with pytest.raises(
        ValueError, match=r"OptimizerConfig.adam_beta1 .* MegatronConfig.adam_betas"
    ):
        split_options({"adam_beta1": 0.8})
    with pytest.raises(
        ValueError, match=r"'overlap_grad_reduce' is a DistributedDataParallelConfig"
    ):
        split_options({"overlap_grad_reduce": True})  # megatron's DDP is not what runs here


def test_virtual_pipeline_stages_set_the_backends_vpp(model_dirs):
    options = split_options({"virtual_pipeline_model_parallel_size": 2})
    assert (options.routed, options.transformer) == ({"vpp": 2}, {})
    path = model_dirs["qwen3-4layers"][0]
    assert (
        MegatronConfig(hf_path=path, pp=2, megatron={"virtual_pipeline_model_parallel_size": 2}).vpp
        == 2
    )
    with pytest.raises(ValueError, match=r"vpp=2 .* needs pp > 1"):
        MegatronConfig(hf_path=path, vpp=2)
    assert MegatronConfig(hf_path=model_dirs["qwen3-moe-4layers"][0], pp=2, vpp=2, ep=2).vpp == 2
    two_layers = model_dirs["qwen3-moe"][0]  # megatron would stop at an assertion
    with pytest.raises(
        ValueError, match=r"has 2 layers, which do not split evenly over pp=2 x vpp=2"
    ):
        MegatronConfig(hf_path=two_layers, pp=2, vpp=2)


def test_features_the_backend_does_not_run_are_refused_saying_why():
    with pytest.raises(ValueError, match=r"'fp8' is not supported .* Transformer Engine"):
        split_options({"fp8": "hybrid"})
