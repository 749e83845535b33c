"""Four gloo ranks on 127.0.0.1 (one spawn for the module): pipeline parallelism combined
with context parallelism (PP=2 x CP=2), with expert parallelism (PP=2 x EP=2, so DP=2),
with tensor parallelism (PP=2 x TP=2 + SP; the last two also on DeepSeek-V3's MLA and
sigmoid-routed shared-expert MoE) and virtual stages with experts (PP=2 x vpp=2 x EP=2,
megatron's interleaved schedule) equals the unsplit model: log-probs, loss,
gradients, grad norm, HF export; checkpoints resume exactly."""

import pytest
import tiny
import torch
from four_rank_job import rank_checks
from multi_rank import assert_same_step, one_rank_reference, spawn_gloo

pytestmark = pytest.mark.integration
LAYOUTS = {
    "pp2_cp2": "qwen3",
    "pp2_ep2": "qwen3-moe",
    "tp2_pp2": "qwen3",
    "pp2_vpp2_ep2": "qwen3-moe-4layers",
    "deepseek_pp2_ep2": "deepseek_v3-4layers",
    "deepseek_tp2_pp2": "deepseek_v3-4layers",
}


@pytest.fixture(scope="module")
def job(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("job4") / "results.pt"
    dirs = {name: str(d) for name, (d, _) in model_dirs.items()}
    return spawn_gloo(rank_checks, 4, out, dirs, str(out))


@pytest.fixture(scope="module")
def reference(world1, model_dirs):
    """The full batch in one micro-batch on one rank."""
    return {name: one_rank_reference(model_dirs[name][0]) for name in set(LAYOUTS.values())}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_combination_equals_one_rank(job, reference, model_dirs, layout):
    got, expected = job[layout], reference[LAYOUTS[layout]]
    assert got["micro_batches"] >= 2  # the 1F1B schedule interleaves micro-batches
    assert got["chunks"] == (2 if "vpp2" in layout else 1)  # model chunks on each stage
    torch.testing.assert_close(got["log_probs"], expected["log_probs"], atol=1e-5, rtol=0)
    assert_same_step(got, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_combination_exports_the_hf_weights(job, model_dirs, layout):
    original = tiny.hf_files(model_dirs[LAYOUTS[layout]][0])
    exported = job[layout]["exported"]
    assert set(exported) == set(original)
    assert all(torch.equal(exported[n], original[n]) for n in original)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_combination_checkpoint_resumes(job, layout):
    assert job[layout]["reloaded_equal"]  # weights back to the saved step
    assert job[layout]["resumed_equal"]  # AdamW moments too: the next step is the same
