"""Packed forward (position ids restarting per sequence, boundary-respecting attention)
equals the ordinary padded forward, for every supported family and implementation."""

import pytest
import torch
from fsdp_tiny import CONFIGS, padded_log_probs, padded_logits, plain_model, tokens_batch

from rl_fsdp.attention import block_causal_mask, register_packed_attention
from rl_fsdp.forward import packed_forward, packed_log_probs


def test_block_causal_mask_by_hand():
    mask = block_causal_mask(torch.tensor([0, 2, 3, 5], dtype=torch.int32), 5)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def _packed_model(family: str):
    model = plain_model(CONFIGS[family])
    model.config._attn_implementation = register_packed_attention()
    return model


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("impl", ["sdpa_mask", "sdpa_grouped", "sdpa_per_doc"])
def test_packed_logits_equal_padded(family, impl, monkeypatch):
    monkeypatch.setattr("rl_fsdp.attention.PER_DOC_UP_TO", 0)  # sdpa_grouped groups even 3
    batch = tokens_batch()
    model = plain_model(CONFIGS[family]).eval()
    packed_model = _packed_model(family).eval()
    with torch.no_grad():
        expected = padded_logits(model, batch)
        got = packed_forward(packed_model, batch.tokens, batch.cu_seqlens, impl)
    assert got.shape == expected.shape == (batch.num_tokens, 512)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_packing_changes_nothing_but_crossing_boundaries_would():
    """A control: the same packed row with one long sequence differs, so the test above
    would catch attention leaking across documents."""
    batch = tokens_batch(lengths=[6, 6])
    model = _packed_model("qwen2").eval()
    with torch.no_grad():
        split = packed_forward(model, batch.tokens, batch.cu_seqlens, "sdpa_mask")
        joined = packed_forward(model, batch.tokens, torch.tensor([0, 12]), "sdpa_mask")
    torch.testing.assert_close(split[:6], joined[:6])
    assert (split[6:] - joined[6:]).abs().max() > 1e-3


@pytest.mark.parametrize(("impl", "temperature"), [("sdpa_mask", 1.0), ("sdpa_per_doc", 0.7)])
def test_packed_log_probs_and_grads_equal_padded(impl, temperature):
    batch = tokens_batch()
    model, packed_model = plain_model(CONFIGS["qwen2"]), _packed_model("qwen2")
    expected = padded_log_probs(model, batch, temperature)
    got, entropy = packed_log_probs(
        packed_model, batch, impl=impl, temperature=temperature, chunk_size=16
    )
    ends = batch.cu_seqlens[1:].long() - 1
    got = got.index_fill(0, ends, 0.0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert entropy is None
    (expected * batch.loss_mask).sum().backward()
    (got * batch.loss_mask).sum().backward()
    for (name, p), q in zip(model.named_parameters(), packed_model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_packed_forward_skips_hugging_faces_mask_code(monkeypatch):
    """A packed pass never runs Hugging Face's mask preparation (its packed-sequence
    check reads position ids back from the device); the logits stay those of the padded
    forward (tested above for every implementation)."""
    import transformers.masking_utils as masking

    def refuse(*args, **kwargs):
        raise AssertionError("mask code ran")

    monkeypatch.setattr(masking, "find_packed_sequence_indices", refuse)
    model = plain_model(CONFIGS["qwen2"])
    model.config._attn_implementation = register_packed_attention()
    batch = tokens_batch()
    logits = packed_forward(model, batch.tokens, batch.cu_seqlens, "sdpa_per_doc")
    torch.testing.assert_close(logits, padded_logits(model, batch), rtol=1e-4, atol=1e-4)
