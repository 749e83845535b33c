"""The FlexAttention path: document ids, the tile-level block mask against the token-level
mask it stands for, and (forward only: FlexAttention has no CPU backward) packed logits
equal to the padded forward. Gradients through the compiled kernel: test_fsdp_gpu.py."""

import pytest
import torch
from fsdp_tiny import CONFIGS, padded_logits, plain_model, tokens_batch

from rl_fsdp.attention import register_packed_attention, resolve_attention
from rl_fsdp.flex import (
    BLOCK,
    bucket_length,
    document_block_mask,
    document_ids,
    tile_masks,
)
from rl_fsdp.forward import packed_forward


def test_document_ids_give_each_padding_token_its_own_document():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    assert document_ids(cu, 8).tolist() == [0, 0, 1, 1, 1, 2, 3, 4]


@pytest.mark.parametrize(("n", "bucket"), [(1, 1024), (1024, 1024), (1025, 2048), (8192, 8192)])
def test_bucket_length(n, bucket):
    assert bucket_length(n) == bucket


def _token_mask(doc: torch.Tensor) -> torch.Tensor:
    causal = torch.ones(doc.numel(), doc.numel(), dtype=torch.bool).tril()
    return (doc[:, None] == doc[None, :]) & causal


@pytest.mark.parametrize(
    "lengths",
    [
        [100, 200, 1, 599],  # boundaries inside tiles, a one-token sequence, padding
        [128, 256, 640],  # boundaries on tile edges, no padding
        [1024],  # one sequence filling the bucket
        [3, 5, 700, 300, 1000],  # spills into a second bucket (2048)
    ],
)
def test_tiles_cover_exactly_the_token_mask(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    length = bucket_length(sum(lengths))
    doc = document_ids(cu, length)
    tiles = length // BLOCK
    blocks = _token_mask(doc).view(tiles, BLOCK, tiles, BLOCK)
    partial, full = tile_masks(doc)
    assert torch.equal(full, blocks.all(3).all(1))  # full tiles need no mask_mod
    assert torch.equal(partial | full, blocks.any(3).any(1))  # nothing allowed is skipped
    assert not (partial & full).any()
    dense = document_block_mask(cu, length).to_dense()[0, 0].bool()
    assert torch.equal(dense, partial | full)


def test_block_mask_rejects_a_length_off_the_tile_grid():
    with pytest.raises(ValueError, match="multiple of"):
        document_block_mask(torch.tensor([0, 10]), 1000)


def test_flex_needs_cuda():
    with pytest.raises(ValueError, match="cuda"):
        resolve_attention("flex", torch.device("cpu"), "fp32")
    assert resolve_attention("auto", torch.device("cpu")) == "sdpa_grouped"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_flex_logits_equal_padded(family):
    batch = tokens_batch()
    model = plain_model(CONFIGS[family]).eval()
    packed_model = plain_model(CONFIGS[family]).eval()
    packed_model.config._attn_implementation = register_packed_attention()
    with torch.no_grad():
        expected = padded_logits(model, batch)
        got = packed_forward(packed_model, batch.tokens, batch.cu_seqlens, "flex")
    assert got.shape == expected.shape == (batch.num_tokens, 512)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_compile_layers_is_refused_on_cpu():
    from rl_fsdp import FSDPConfig
    from rl_fsdp.modeling import shard_model

    config = FSDPConfig(model_config=CONFIGS["qwen2"], compile_layers=True)
    with pytest.raises(ValueError, match="compile_layers"):
        shard_model(plain_model(CONFIGS["qwen2"]), config, torch.device("cpu"))


def test_layout_pads_flex_to_the_budget_bucket():
    from rl_fsdp.attention import PackedLayout

    cu = torch.tensor([0, 30, 100])
    small = PackedLayout.from_cu_seqlens(cu, "flex", torch.device("cpu"))
    budget = PackedLayout.from_cu_seqlens(cu, "flex", torch.device("cpu"), pad_to=5000)
    assert small.block_mask.seq_lengths == (1024, 1024)
    assert budget.block_mask.seq_lengths == (8192, 8192)
    assert budget.lengths == (30, 70)
    assert PackedLayout.from_cu_seqlens(cu, "sdpa_mask", torch.device("cpu")).block_mask is None


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_compiled_layers_trace_flex_once_for_every_length():
    """What compile_layers relies on (traced here with dynamo's eager backend, forward only):
    the packed flex path compiles to one graph without breaks for micro-batches of any
    length, new layouts included, and keeps the padded forward's logits."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from rl_fsdp.modeling import decoder_layers

    torch._dynamo.reset()
    counters.clear()
    model = plain_model(CONFIGS["qwen2"]).eval()
    model.config._attn_implementation = register_packed_attention()
    for layer in decoder_layers(model):
        layer.compile(dynamic=True, backend="eager")
    reference = plain_model(CONFIGS["qwen2"]).eval()
    with torch.no_grad():
        for lengths in ([9, 17, 5], [20, 8, 14, 11], [40, 3]):
            batch = tokens_batch(lengths=lengths)
            got = packed_forward(model, batch.tokens, batch.cu_seqlens, "flex", pad_to=100)
            expected = padded_logits(reference, batch)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    torch._dynamo.reset()
