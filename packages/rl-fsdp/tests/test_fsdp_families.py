"""The model families users bring (docs/models.md), each built from its transformers config
(hidden 64, 2 layers, vocab 512): the backend's packed log-probs equal a padded eager HF
forward (fp32, |Δ| <= 1e-5), and one SFT step on one gloo rank has the HF model's loss and
gradient norm and moves the weights. Sliding windows shorter than the sequences and
Gemma2's attention softcap go through the exact per-sequence attention path."""

import pytest
import torch
from fsdp_tiny import FAMILIES, LENGTHS, WINDOW, padded_log_probs, plain_model, tokens_batch

from rl_core.objective import Objective, sft_objective
from rl_fsdp import FSDPBackend, FSDPConfig
from rl_fsdp.attention import _packed_mask, packed_attention, register_packed_attention
from rl_fsdp.forward import packed_forward


@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist

    from rl_core.distributed import init_distributed

    yield init_distributed(device="cpu")
    dist.destroy_process_group()


def reference(family: str):
    """The same seeded model with Hugging Face's eager attention: its log-probs and the
    SFT loss and gradient norm of ``tokens_batch()``."""
    model = plain_model(FAMILIES[family], attention="eager")
    batch = tokens_batch()
    log_probs = padded_log_probs(model, batch)
    loss, _ = sft_objective(log_probs=log_probs, mask=batch.loss_mask)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    return log_probs.detach(), float(loss), float(norm)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_log_probs_and_one_sft_step_equal_hugging_face(world_of_one, family):
    config = FSDPConfig(
        model_config=FAMILIES[family], device="cpu", objective=Objective(mode="sft"), lr=1e-2
    )
    backend = FSDPBackend(config, dist_info=world_of_one)
    batch = tokens_batch().with_global_denominators()
    expected, loss, grad_norm = reference(family)
    before = backend.compute_log_probs(batch)
    ends = batch.cu_seqlens[1:].long() - 1
    torch.testing.assert_close(before.index_fill(0, ends, 0.0), expected, atol=1e-5, rtol=0)
    metrics = backend.train_step(batch)
    assert metrics["loss/sft"] == pytest.approx(loss, rel=1e-5)
    assert metrics["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    moved = (backend.compute_log_probs(batch) - before)[batch.loss_mask.bool()]
    assert float(moved.abs().max()) > 1e-3


@pytest.mark.parametrize(
    ("family", "feature"),
    [
        ("mistral", "sliding_window"),
        ("gemma2", "sliding_window"),
        ("gemma2", "softcap"),
        ("gemma3_text", "sliding_window"),
    ],
)
def test_windows_and_softcap_matter_here(family, feature):
    """A control: the packed attention told that a layer has no window (or no softcap)
    gives other logits on these configs, so the test above would catch either ignored."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def blind(module, query, key, value, attention_mask, **kwargs):
        return packed_attention(
            module, query, key, value, attention_mask, **{**kwargs, feature: None}
        )

    assert max(LENGTHS) > WINDOW
    model = plain_model(FAMILIES[family], attention="eager").eval()
    batch = tokens_batch()
    AttentionInterface.register("rl_blind", blind)
    AttentionMaskInterface.register("rl_blind", _packed_mask)
    with torch.no_grad():
        model.config._attn_implementation = register_packed_attention()
        exact = packed_forward(model, batch.tokens, batch.cu_seqlens, "sdpa_mask")
        model.config._attn_implementation = "rl_blind"
        blind_logits = packed_forward(model, batch.tokens, batch.cu_seqlens, "sdpa_mask")
    assert float((exact - blind_logits).abs().max()) > 1e-4


def test_exported_weights_carry_checkpoint_names(world_of_one, tmp_path):
    """transformers 5 fuses Qwen3-MoE's experts in memory; the export (to engines and to
    disk) splits them into the per-expert names a checkpoint has and SGLang's loader
    expects, equal to ``save_pretrained``'s tensors, and the directory loads back."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = FSDPConfig(model_config=FAMILIES["qwen3_moe"], device="cpu", fsdp_on_one_rank=True)
    backend = FSDPBackend(config, dist_info=world_of_one)
    exported = {n: t for b in backend.export_weights(bucket_bytes=1 << 20) for n, t in b}
    plain_model(FAMILIES["qwen3_moe"]).save_pretrained(tmp_path / "hf")
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in exported
    assert set(exported) == set(saved)
    assert all(torch.equal(exported[name], saved[name]) for name in saved)
    backend.export_hf(tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    live = dict(backend.model.named_parameters())
    for name, tensor in loaded.named_parameters():
        assert torch.equal(tensor, live[name].full_tensor()), name
