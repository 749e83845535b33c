import pytest
import torch

from rl_core.fp8 import (
    FP8_DTYPE,
    MIN_BLOCK_MAX,
    dequantize_block_fp8,
    dequantize_named,
    is_quantized_weight,
    quantization_config,
    quantize_block_fp8,
    quantize_named,
)

# A [3, 5] weight in 2x2 blocks: a 2x3 grid of blocks, the last row and column of blocks
# cut short (no padding in the output).
WEIGHT = torch.tensor(
    [
        [448.0, 1.0, 0.0, 0.0, 2.0],
        [-3.0, 224.0, 0.0, 0.0, 0.3],
        [5.0, -0.5, 0.0, 0.0, 0.0],
    ]
)


def test_block_quantisation_by_hand():
    quantized, scale = quantize_block_fp8(WEIGHT, (2, 2))
    assert quantized.dtype == FP8_DTYPE and quantized.shape == (3, 5)
    zero = MIN_BLOCK_MAX / 448
    # scale = block max / 448: 448 | 0 (clamped) | 2 over rows 0-1; 5 | 0 | 0 over row 2
    expected_scale = torch.tensor([[1.0, zero, 2 / 448], [5 / 448, zero, zero]])
    torch.testing.assert_close(scale, expected_scale, rtol=1e-6, atol=0)
    # Q = W / scale, rounded to e4m3: 0.3 * 224 = 67.2 -> 64 (e4m3 spacing is 8 in [64, 128));
    # -0.5 * 448 / 5 = -44.8 -> -44 (spacing 4 in [32, 64))
    expected_q = torch.tensor(
        [
            [448.0, 1.0, 0.0, 0.0, 448.0],
            [-3.0, 224.0, 0.0, 0.0, 64.0],
            [448.0, -44.0, 0.0, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(quantized.float(), expected_q, rtol=0, atol=0)
    back = dequantize_block_fp8(quantized, scale, torch.float32, (2, 2))
    expected_back = expected_q * torch.tensor(
        [[1.0, 1.0, 0, 0, 2 / 448], [1.0, 1.0, 0, 0, 2 / 448], [5 / 448, 5 / 448, 0, 0, 0]]
    )
    torch.testing.assert_close(back, expected_back, rtol=1e-6, atol=0)
    assert abs(back[1, 4].item() - 0.3) == pytest.approx(0.3 - 64 * 2 / 448, rel=1e-5)


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (7, 300)])
def test_round_trip_error_bound(shape):
    """e4m3 keeps 3 mantissa bits: a value in the normal range is off by at most 1/16 of
    itself, one in the subnormal range by at most half the smallest step (2**-10 of the
    block's scale)."""
    torch.manual_seed(0)
    weight = torch.randn(shape, dtype=torch.bfloat16) * torch.logspace(-3, 0, shape[1])
    quantized, scale = quantize_block_fp8(weight)
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = dequantize_block_fp8(quantized, scale, torch.float32)
    scale_NK = scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    bound = weight.float().abs() / 16 + scale_NK * 2.0**-10
    assert ((back - weight.float()).abs() <= bound * (1 + 1e-6)).all()
    assert (back - weight.float()).abs().max() > 0  # it does round


def test_dequantise_refuses_a_scale_of_another_shape():
    quantized, scale = quantize_block_fp8(torch.ones(130, 10))
    with pytest.raises(ValueError, match="expected \\(2, 1\\)"):
        dequantize_block_fp8(quantized, scale[:1], torch.float32)


def test_named_round_trip_and_which_names():
    named = [
        ("model.embed_tokens.weight", torch.randn(16, 8)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(8)),
        ("model.layers.0.input_layernorm.weight", torch.randn(8)),
        ("model.layers.0.mlp.gate.weight", torch.randn(4, 8)),
        ("model.layers.0.mlp.experts.3.down_proj.weight", torch.randn(8, 6)),
        ("lm_head.weight", torch.randn(16, 8)),
    ]
    sent = list(quantize_named(named))
    assert [n for n, _ in sent] == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.weight_scale_inv",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.3.down_proj.weight",
        "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv",
        "lm_head.weight",
    ]
    back = dict(dequantize_named(sent, torch.float32))
    assert list(back) == [n for n, _ in named]
    for name, tensor in named:
        exact = not is_quantized_weight(name, tensor.shape)
        tolerance = 0 if exact else tensor.abs().max().item() / 16
        torch.testing.assert_close(back[name], tensor, rtol=0, atol=tolerance)
    with pytest.raises(ValueError, match="came without"):
        dequantize_named(sent[1:2], torch.float32)


def test_quantization_config_is_deepseek_v3s():
    assert quantization_config(["lm_head", "model.embed_tokens", "lm_head"]) == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
    }
