"""Four gloo ranks on 127.0.0.1 (one spawn for the module): pipeline parallelism combined
with context parallelism (PP=2 x CP=2), with expert parallelism (PP=2 x EP=2, so DP=2) and
with tensor parallelism (PP=2 x TP=2 + SP) equals the unsplit model: log-probs, loss, gradients, grad norm, HF export; checkpoints
resume exactly."""

import pytest
import tiny
import torch
import torch.multiprocessing as mp
from dist_job import LENGTHS, POLICY
from four_rank_job import run

from rl_core.distributed import free_port
from rl_megatron.backend import MegatronBackend
from rl_megatron.config import MegatronConfig

pytestmark = pytest.mark.integration
LAYOUTS = {"pp2_cp2": "qwen3", "pp2_ep2": "qwen3-moe", "tp2_pp2": "qwen3"}


@pytest.fixture(scope="module")
def job(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("job4") / "results.pt"
    dirs = {name: str(d) for name, (d, _) in model_dirs.items()}
    mp.spawn(run, args=(4, free_port(), dirs, str(out)), nprocs=4, join=True)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def reference(world1, model_dirs):
    """The full batch in one micro-batch on one rank."""
    results = {}
    for name in set(LAYOUTS.values()):
        backend = MegatronBackend(MegatronConfig(hf_path=model_dirs[name][0], **POLICY))
        batch = tiny.random_batch(LENGTHS, seed=11)
        results[name] = {"log_probs": backend.compute_log_probs(batch)}
        results[name]["metrics"] = backend.forward_backward(batch)
        results[name]["grads"] = backend.hf_gradients()
    return results


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_combination_equals_one_rank(job, reference, model_dirs, layout):
    got, expected = job[layout], reference[LAYOUTS[layout]]
    assert got["micro_batches"] >= 2  # the 1F1B schedule interleaves micro-batches
    torch.testing.assert_close(got["log_probs"], expected["log_probs"], atol=1e-5, rtol=0)
    for key in ("loss/total", "loss/pg", "actor/entropy", "pg/clipfrac"):
        assert got["metrics"][key] == pytest.approx(expected["metrics"][key], abs=1e-5), key
    assert set(got["grads"]) == set(expected["grads"])
    for hf_name, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][hf_name], grad, atol=1e-5, rtol=1e-4, msg=hf_name)
    full_norm = torch.stack([g.norm() for g in expected["grads"].values()]).norm()
    assert got["grad_norm"] == pytest.approx(float(full_norm), rel=1e-5)


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
