"""engine.quantization=fp8 (FP8 rollout): refused before Ray starts where it cannot work;
otherwise SGLang starts on the triton FP8 kernels, the engines start from a converted
checkpoint in the run dir, and every synced bucket leaves quantised."""

import json

import pytest
import torch

from rl_core.fp8 import FP8_DTYPE
from rl_launcher.config.loader import load_config
from rl_launcher.infra.weight_sync import quantized_buckets, sync_options
from rl_launcher.roles.engine_servers import sglang_server_args
from rl_launcher.session.model import engine_model_dir

FP8 = "engine.quantization=fp8"
# SmolLM2-135M's shape: 3 KV heads of 64 = 192, not a multiple of 128
SMOL = (
    "model.init_config={model_type: llama, hidden_size: 576, intermediate_size: 1536, "
    "num_hidden_layers: 1, num_attention_heads: 9, num_key_value_heads: 3, vocab_size: 512}"
)
SGLANG = ["engine.kind=sglang", "cluster.device=cuda"]
# a 1.5B Qwen2 shape's widths: 12 x 128, 2 x 128, 8960 = 70 x 128
QWEN_1_5B = (
    "model.init_config={model_type: qwen2, hidden_size: 1536, intermediate_size: 8960, "
    "num_hidden_layers: 1, num_attention_heads: 12, num_key_value_heads: 2, vocab_size: 512}"
)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([FP8, "model.lora_rank=8"], r"model\.lora_rank=8 trains adapters"),
        ([FP8, SMOL, *SGLANG], r"num_key_value_heads x head_dim = 192"),
        (
            [
                FP8,
                "cluster.colocate=false",
                "cluster.devices_per_node=2",
                "engine.weight_flatten=false",
            ],
            r"keep engine\.weight_flatten=true",
        ),
        (
            [FP8, QWEN_1_5B, *SGLANG, "engine.devices_per_engine=4", "cluster.devices_per_node=4"],
            r"num_key_value_heads x head_dim = 256",  # 256 / TP 4 = 64
        ),
    ],
)
def test_fp8_rollout_is_refused_where_it_cannot_work(args, message):
    with pytest.raises(ValueError, match=message):
        load_config(args)


def test_sglang_serves_fp8_on_its_triton_block_kernels():
    config, _ = load_config([FP8, QWEN_1_5B, *SGLANG])
    args = sglang_server_args(config, memory_saver=False)
    assert args["quantization"] == "fp8" and args["fp8_gemm_backend"] == "triton"
    plain, _ = load_config([QWEN_1_5B, *SGLANG])
    assert "quantization" not in sglang_server_args(plain, memory_saver=False)
    load_config([FP8, SMOL])  # the embedded engine takes any shape


def test_engines_start_from_a_converted_checkpoint_and_buckets_leave_quantised(tmp_path):
    from rl_sglang.tiny import save_tiny_model

    source = save_tiny_model(tmp_path / "model", seed=0)
    config, _ = load_config([FP8, f"logging.run_dir={tmp_path / 'run'}"])
    converted = engine_model_dir(config, source)
    assert converted == tmp_path / "run" / "initial_model_fp8"
    quant = json.loads((converted / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "fp8"
    plain, _ = load_config([f"logging.run_dir={tmp_path / 'run'}"])
    assert engine_model_dir(plain, source) == source

    how = sync_options(config, tmp_path / "run")
    bucket = [
        ("model.layers.0.mlp.down_proj.weight", torch.ones(8, 4)),
        ("model.norm.weight", torch.ones(4)),
    ]
    [sent] = list(quantized_buckets(iter([bucket]), how))
    assert [(n, t.dtype) for n, t in sent] == [
        ("model.layers.0.mlp.down_proj.weight", FP8_DTYPE),
        ("model.layers.0.mlp.down_proj.weight_scale_inv", torch.float32),
        ("model.norm.weight", torch.float32),
    ]
    assert list(quantized_buckets([bucket], sync_options(plain, tmp_path))) == [bucket]
