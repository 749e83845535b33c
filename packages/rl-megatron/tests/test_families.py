"""Model families users bring, each built from its transformers config (hidden 64, 2 layers,
vocab 500, random weights): HF -> Megatron -> HF is bit-identical and Megatron's logits
equal HF's within the tolerance of the dtype, or the backend refuses the family with a
message naming it and what is missing (docs/models.md keeps the table).

Tolerances: |Δ| of every logit against the fp32 HF model's, on CPU (logits of std ~0.16,
max ~0.8 here): fp32 max 1e-5 (measured <= 2.1e-7); bf16 parameters max 0.02 and mean
0.003 (measured <= 0.0065 and 0.0009).
"""

import itertools
import re

import pytest
import tiny
import torch

from rl_megatron.backend import MegatronBackend
from rl_megatron.config import MegatronConfig
from rl_megatron.forward import forward_logits
from rl_megatron.shape import model_shape

LENGTHS = [9, 40, 6, 23]  # 40 > the llama3-rope case's original context of 32
SUPPORTED = ["llama", "llama3-rope", "qwen2", "qwen3", "qwen3_moe", "mistral"]
TOLERANCE = {"fp32": {"max": 1e-5, "mean": 1e-6}, "bf16": {"max": 0.02, "mean": 0.003}}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: (root / f, tiny.save_tiny_model(root / f, f, seed=7)) for f in SUPPORTED}


def hf_logits(model, batch) -> torch.Tensor:
    """Packed ``[N, V]`` fp32 logits of the HF model, one sequence at a time."""
    pieces = itertools.pairwise(batch.cu_seqlens.tolist())
    with torch.no_grad():
        return torch.cat([model(batch.tokens[None, a:b]).logits[0].float() for a, b in pieces])


@pytest.mark.parametrize("family", SUPPORTED)
def test_hf_to_megatron_to_hf_is_bit_identical(world1, family_dirs, family, tmp_path):
    directory, _ = family_dirs[family]
    backend = MegatronBackend(MegatronConfig(hf_path=directory, device="cpu"))
    backend.export_hf(tmp_path / "out")
    original, saved = tiny.hf_files(directory), tiny.hf_files(tmp_path / "out")
    assert set(saved) == set(original)
    for name, tensor in original.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", SUPPORTED)
def test_megatron_logits_equal_hf(world1, family_dirs, family, precision):
    directory, hf_model = family_dirs[family]
    config = MegatronConfig(hf_path=directory, device="cpu", precision=precision)
    backend = MegatronBackend(config)
    batch = tiny.random_batch(LENGTHS, seed=3)
    with torch.no_grad():
        logits, held = forward_logits(backend.model, batch.tokens, batch.cu_seqlens)
    assert torch.equal(held, torch.arange(batch.num_tokens))
    diff = (logits[:, : tiny.VOCAB].float() - hf_logits(hf_model, batch)).abs()
    bound = TOLERANCE[precision]
    assert float(diff.max()) < bound["max"] and float(diff.mean()) < bound["mean"], (
        float(diff.max()),
        float(diff.mean()),
    )


def test_scaled_rope_changes_the_logits(world1, family_dirs):
    """The llama3 rope case can fail: megatron's unscaled frequencies give other logits."""
    directory, hf_model = family_dirs["llama3-rope"]
    backend = MegatronBackend(MegatronConfig(hf_path=directory, device="cpu"))
    backend.model.rotary_pos_emb.inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2) / 16)
    batch = tiny.random_batch(LENGTHS, seed=3)
    with torch.no_grad():
        logits, _ = forward_logits(backend.model, batch.tokens, batch.cu_seqlens)
    assert float((logits[:, : tiny.VOCAB] - hf_logits(hf_model, batch)).abs().max()) > 1e-3


REFUSED = {
    "gemma": ("rl-megatron: gemma (scaled embeddings", {}),
    "gemma2": ("rl-megatron: gemma2 (attention/final logit softcapping", {}),
    "gemma3_text": ("rl-megatron: gemma3_text (sandwich norms", {}),
    "mistral": (
        "rl-megatron: mistral with sliding-window attention (sliding_window=64)",
        {"sliding_window": 64},
    ),
    "qwen2": (
        "rl-megatron: qwen2 with sliding-window",
        {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
    ),
    "llama": (
        "rl-megatron: llama with rope_type 'yarn' is not supported",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 1e4,
                "original_max_position_embeddings": 64,
            }
        },
    ),
}


@pytest.mark.parametrize("family", list(REFUSED))
def test_unsupported_families_are_refused_by_name(family):
    message, overrides = REFUSED[family]
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        model_shape(tiny.hf_config(family, **overrides))
    assert "use the FSDP backend" in str(error.value)
