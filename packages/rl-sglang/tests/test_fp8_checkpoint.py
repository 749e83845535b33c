"""FP8 checkpoints: written as DeepSeek-V3's are laid out, loaded dequantised by the
embedded engine (its weights and log-probs those of the FP8 weights)."""

import json

import torch
from safetensors import safe_open

from conftest import generate
from rl_core.fp8 import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8
from rl_sglang.engine.core import Engine, load_model
from rl_sglang.fp8_checkpoint import is_fp8_checkpoint, write_fp8_checkpoint
from rl_sglang.tiny import save_tiny_model

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def test_written_checkpoint_and_embedded_load(tmp_path):
    source = save_tiny_model(tmp_path / "bf16", seed=3, hidden_size=160, intermediate_size=200)
    target = write_fp8_checkpoint(source, tmp_path / "run" / "initial_model_fp8")
    assert not is_fp8_checkpoint(source) and is_fp8_checkpoint(target)
    quant = json.loads((target / "config.json").read_text())["quantization_config"]
    assert quant["weight_block_size"] == [128, 128] and quant["fmt"] == "e4m3"
    assert "model.embed_tokens" in quant["modules_to_not_convert"]
    assert "model.layers.0.input_layernorm" in quant["modules_to_not_convert"]
    assert (target / "tokenizer.json").is_file()
    with safe_open(target / "model.safetensors", framework="pt") as handle:
        assert handle.get_tensor(Q_PROJ).dtype == FP8_DTYPE
        assert handle.get_tensor(Q_PROJ + "_scale_inv").shape == (2, 2)  # 160 in 128-blocks
        assert handle.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    assert index[Q_PROJ + "_scale_inv"] == "model.safetensors"
    assert [p.name for p in target.parent.iterdir()] == ["initial_model_fp8"]  # no leftovers

    original, _ = load_model(str(source))
    served, tokenizer = load_model(str(target))
    exact = original.state_dict()[Q_PROJ]
    expected = dequantize_block_fp8(*quantize_block_fp8(exact), torch.float32)
    assert torch.equal(served.state_dict()[Q_PROJ], expected)
    assert not torch.equal(expected, exact)
    norm = "model.norm.weight"
    assert torch.equal(served.state_dict()[norm], original.state_dict()[norm])
    out = generate(
        Engine(served, tokenizer),
        input_ids=[5, 6, 7],
        return_logprob=True,
        sampling_params={"max_new_tokens": 4, "temperature": 0},
    )
    assert len(out[0]["output_ids"]) == 4


def test_conversion_is_kept_for_the_same_source_and_redone_for_a_new_one(tmp_path):
    source = save_tiny_model(tmp_path / "bf16", seed=1)
    target = write_fp8_checkpoint(source, tmp_path / "fp8")
    first = (target / "model.safetensors").stat().st_mtime_ns
    assert (write_fp8_checkpoint(source, target) / "model.safetensors").stat().st_mtime_ns == first
    save_tiny_model(source, seed=2)
    write_fp8_checkpoint(source, target)
    assert (target / "model.safetensors").stat().st_mtime_ns != first


def test_an_export_converts_in_place(tmp_path):
    """A health-restarted engine's weights: the trainer's HF export, converted where it is."""
    export = save_tiny_model(tmp_path / "restore_weights", seed=4)
    assert write_fp8_checkpoint(export, export) == export and is_fp8_checkpoint(export)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["restore_weights"]
    model, _ = load_model(str(export))
    with safe_open(export / "model.safetensors", framework="pt") as handle:
        assert handle.get_tensor(Q_PROJ).dtype == FP8_DTYPE
    assert model.state_dict()[Q_PROJ].dtype == torch.float32
