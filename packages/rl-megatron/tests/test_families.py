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
SUPPORTED = [
    "llama",
    "llama3-rope",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "glm4",
    "deepseek_v3",
    "deepseek_v3-yarn",
    "deepseek_v3-dense",
]
TOLERANCE = {"fp32": {"max": 1e-5, "mean": 1e-6}, "bf16": {"max": 0.02, "mean": 0.003}}
# DeepSeek-V3's sigmoid router picks 4 of 8 experts among near-equal scores (the tiny
# model's router logits have std ~0.16): bf16 rounding flips a pick on a few tokens, which
# moves their logits more than rounding alone (measured max 0.027, mean 0.0009; fp32 exact).
BF16_ROUTING = {(f, "bf16"): {"max": 0.06} for f in ("deepseek_v3", "deepseek_v3-yarn")}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    built = [*SUPPORTED, "deepseek_v3-4layers"]  # the last: for PP=2 only
    return {f: (root / f, tiny.save_tiny_model(root / f, f, seed=7)) for f in built}


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
    bound = TOLERANCE[precision] | BF16_ROUTING.get((family, precision), {})
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


DEEPSEEK_REFUSED = {
    "rope_interleave false": {"rope_interleave": False},
    "attention_bias true": {"attention_bias": True},
    "norm_topk_prob false": {"norm_topk_prob": False},
    "num_experts_per_tok // topk_group = 1": {"num_experts_per_tok": 2},
    "YaRN mscale_all_dim without mscale": {
        "rope_parameters": {**tiny.DEEPSEEK_YARN, "mscale": None}
    },
}


def test_deepseek_v3_rope_types_other_than_yarn_are_refused():
    config = tiny.hf_config("deepseek_v3", rope_parameters={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match=r"deepseek_v3 with rope_type 'linear'.*default, yarn"):
        model_shape(config)


def test_yarn_changes_the_deepseek_v3_logits(family_dirs):
    """A control for the yarn case: the same weights without YaRN give other logits."""
    import copy

    yarn = family_dirs["deepseek_v3-yarn"][1]
    plain = copy.deepcopy(yarn)
    plain.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    plain.model.rotary_emb.__init__(plain.config)
    for layer in plain.model.layers:
        layer.self_attn.__init__(plain.config, layer.self_attn.layer_idx)
    plain.load_state_dict(yarn.state_dict())
    batch = tiny.random_batch(LENGTHS, seed=3)
    assert float((hf_logits(yarn, batch) - hf_logits(plain, batch)).abs().max()) > 1e-3


@pytest.mark.parametrize("what", list(DEEPSEEK_REFUSED))
def test_deepseek_v3_features_megatron_computes_otherwise_are_refused(what):
    with pytest.raises(ValueError, match=re.escape(f"rl-megatron: deepseek_v3 with {what}")):
        model_shape(tiny.hf_config("deepseek_v3", **DEEPSEEK_REFUSED[what]))


def test_deepseek_v3_latent_sizes_must_split_over_tp():
    with pytest.raises(ValueError, match=r"tp=3 must divide the MLA query latent size"):
        model_shape(tiny.hf_config("deepseek_v3", num_attention_heads=6), tp_size=3)


def test_deepseek_v3_group_limits_that_keep_every_group_are_plain_top_k():
    shape = model_shape(tiny.hf_config("deepseek_v3", num_experts_per_tok=3, topk_group=4))
    assert (shape.router_groups, shape.router_group_topk) == (0, 0)


def test_deepseek_v3_mtp_layers_are_not_built_and_said_so(world1, family_dirs, caplog):
    """A config with a multi-token-prediction layer builds the same model (HF's forward
    skips MTP too) and one log line says its weights are ignored."""
    from rl_megatron.models import build_gpt_model

    config = tiny.hf_config("deepseek_v3", num_nextn_predict_layers=1)
    with caplog.at_level("WARNING", logger="rl_megatron.families"):
        model = build_gpt_model(config)
    assert "multi-token-prediction layer(s)" in caplog.text
    assert len(model.decoder.layers) == config.num_hidden_layers


@pytest.fixture(scope="module")
def layout_job(family_dirs, tmp_path_factory):
    """GLM-4 at TP=2, PP=2 and CP=2, DeepSeek-V3 at TP=2 (+SP), EP=2, PP=2, PP=2 x vpp=2
    and CP=2, a dense DeepSeek-V3 at TP=2 without SP: one two-rank spawn."""
    from families_job import rank_checks
    from multi_rank import spawn_gloo

    out = tmp_path_factory.mktemp("layouts") / "results.pt"
    families = LAYOUT_FAMILIES + [family for family, _ in FULL_CASES]
    dirs = {family: str(family_dirs[family][0]) for family in families}
    return spawn_gloo(rank_checks, 2, out, dirs, str(out))


@pytest.fixture(scope="module")
def one_rank_grads(world1, family_dirs):
    """HF-named gradients of the same forward/backward at TP=1, per family."""
    from dist_job import LENGTHS, POLICY

    grads = {}
    for family in LAYOUT_FAMILIES:
        backend = MegatronBackend(MegatronConfig(hf_path=family_dirs[family][0], **POLICY))
        backend.forward_backward(tiny.random_batch(LENGTHS, seed=11))
        grads[family] = backend.hf_gradients()
    return grads


LAYOUT_CASES = [
    ("glm4", "tp2"),
    ("glm4", "pp2"),
    ("deepseek_v3", "tp2+sp"),
    ("deepseek_v3", "ep2"),
    ("deepseek_v3-dense", "tp2"),  # MLA without SP: the rope key's gradient summed over TP
]
LAYOUT_FAMILIES = sorted({family for family, _ in LAYOUT_CASES})


@pytest.mark.integration
@pytest.mark.parametrize(("family", "layout"), LAYOUT_CASES)
def test_new_families_across_ranks_equal_hf(
    layout_job, one_rank_grads, family_dirs, family, layout
):
    """Log-probs equal a teacher-forced HF forward, the export is bit-identical to the HF
    checkpoint, and the gradient equals one rank's."""
    from dist_job import LENGTHS

    directory, hf_model = family_dirs[family]
    got = layout_job[(family, layout)]
    batch = tiny.random_batch(LENGTHS, seed=11)
    mask = batch.loss_mask.bool()
    hf = tiny.hf_log_probs(hf_model, batch).detach()
    torch.testing.assert_close(got["log_probs"][mask], hf[mask], atol=2e-5, rtol=0)
    original = tiny.hf_files(directory)
    assert set(got["exported"]) == set(original)
    for name, tensor in original.items():
        assert torch.equal(got["exported"][name], tensor), name
    wrong = {
        name: float((got["grads"][name] - grad).abs().max() / grad.abs().max())
        for name, grad in one_rank_grads[family].items()
        if not torch.allclose(got["grads"][name], grad, atol=1e-5, rtol=1e-4)
    }
    assert not wrong, "; ".join(f"{n}: {v:.2e}" for n, v in wrong.items())  # relative max |Δ|


FULL_CASES = [
    ("deepseek_v3-4layers", "pp2"),
    ("deepseek_v3-4layers", "pp2+vpp2"),
    ("deepseek_v3", "cp2"),
    ("deepseek_v3-yarn", "cp2"),
    ("glm4", "cp2"),
]


@pytest.mark.integration
@pytest.mark.parametrize(("family", "layout"), FULL_CASES)
def test_new_families_with_pipeline_or_context_parallel_equal_one_rank(
    world1, layout_job, family_dirs, family, layout
):
    """DeepSeek-V3 at PP=2 (stage 0: the dense layer and an MoE one), at PP=2 x vpp=2
    (megatron's interleaved schedule; stage 0: the dense layer 0 and the MoE layer 2) and
    at CP=2 (MLA's rope keys and values all-gathered in zigzag order; plain rope and YaRN),
    GLM-4 at CP=2 (its partial interleaved rope cut to each rank's zigzag chunks), over
    two micro-batches (three with virtual stages, run as four): log-probs equal one rank's
    and a teacher-forced HF forward; loss, gradients and grad norm one rank's; export
    bit-identical; resume exact."""
    from dist_job import LENGTHS
    from multi_rank import assert_same_step, one_rank_reference

    directory, hf_model = family_dirs[family]
    got, expected = layout_job[(family, layout)], one_rank_reference(directory)
    virtual = "vpp2" in layout
    assert (got["micro_batches"], got["chunks"]) == ((3, 2) if virtual else (2, 1))
    torch.testing.assert_close(got["log_probs"], expected["log_probs"], atol=1e-5, rtol=0)
    batch = tiny.random_batch(LENGTHS, seed=11)
    mask = batch.loss_mask.bool()
    hf = tiny.hf_log_probs(hf_model, batch).detach()
    torch.testing.assert_close(got["log_probs"][mask], hf[mask], atol=2e-5, rtol=0)
    assert_same_step(got, expected)
    original = tiny.hf_files(directory)
    assert set(got["exported"]) == set(original)
    assert all(torch.equal(got["exported"][n], original[n]) for n in original)
    assert got["reloaded_equal"] and got["resumed_equal"]


@pytest.mark.parametrize("family", ["glm4", "deepseek_v3"])
def test_new_families_resume_from_a_distributed_checkpoint(world1, family_dirs, family, tmp_path):
    """Their extra trained modules (GLM-4's output norms, MLA's whole kv down projection)
    are in megatron's sharded state dict: step, save, step, load gives the saved weights."""
    from dist_job import LENGTHS, POLICY

    backend = MegatronBackend(MegatronConfig(hf_path=family_dirs[family][0], **POLICY))
    batch = tiny.random_batch(LENGTHS, seed=11)
    backend.train_step(batch)
    backend.save_checkpoint(tmp_path / "ckpt")
    saved = backend.compute_log_probs(batch)
    backend.train_step(batch)
    assert float((backend.compute_log_probs(batch) - saved).abs().max()) > 1e-3
    backend.load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(backend.compute_log_probs(batch), saved)
