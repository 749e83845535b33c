"""bf16 on GPUs (skipped without CUDA): with precision="bf16" (bf16 parameters, fp32 main
gradients and master weights, no autocast) Megatron log-probs stay within stated
tolerances of the fp32 HF model and training lowers the loss, on one GPU (rl_core's
Triton log-probs) and on two with TP=2 (+SP, bf16 reduce-scatter), PP=2 and CP=2.

Tolerances (bf16 matmuls, fp32 softmax): mean |Δ log-prob| < 0.02, max < 0.15. The
layers are compiled (cuda's default); on one GPU they also equal eager layers.
"""

import pytest
import tiny
import torch
import torch.multiprocessing as mp
from gpu_job import LENGTHS, run

from rl_core.distributed import free_port

pytestmark = pytest.mark.gpu


def _run_job(world: int, hf_path, out_path, layout: str) -> dict:
    """Spawned (fresh interpreters): the GPU job never sees the CPU shim of other tests."""
    args = (world, free_port(), str(hf_path), str(out_path), layout)
    mp.start_processes(run, args=args, nprocs=world, start_method="spawn")
    return torch.load(out_path, weights_only=False)


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpu") / "qwen3"
    return directory, tiny.save_tiny_model(directory, "qwen3", seed=4)


@pytest.mark.parametrize("layout", ["single", "tp", "pp", "cp"])
def test_bf16_log_probs_and_training(gpu_model, tmp_path, layout):
    world = 1 if layout == "single" else 2
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    directory, hf_model = gpu_model
    result = _run_job(world, directory, tmp_path / "out.pt", layout)
    batch = tiny.random_batch(LENGTHS, seed=21)
    mask = batch.loss_mask.bool()
    expected = tiny.hf_log_probs(hf_model, batch).detach()
    diff = (result["log_probs"][mask] - expected[mask]).abs()
    assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.15, (diff.mean(), diff.max())
    assert result["losses"][-1] < result["losses"][0]
    assert set(result["exported"]) == {n for n, _ in hf_model.state_dict().items()}
    whole = {"single": 2, "pp": 1, "cp": 2, "tp": 0}[layout]  # tp: the norms only
    assert result["compiled_layers"]["whole_layers"] == whole
    if layout == "single":
        _assert_compiled_equal_eager(result)


def test_no_cudnn_attention_runs_flash_or_efficient(gpu_model, tmp_path):
    """``attention_backends="no_cudnn"`` (and widths bucketed to 64): the compiled layers'
    forward and backward run no cuDNN attention, and the log-probs stay within the bf16
    tolerances of HF's (cuDNN is what SDPA picks first on Hopper: ``single`` records it)."""
    directory, hf_model = gpu_model
    result = _run_job(1, directory, tmp_path / "out.pt", "no_cudnn")
    ops = result["attention_ops"]
    assert ops and not any("cudnn" in op for op in ops), ops
    assert any("flash" in op or "efficient" in op for op in ops), ops
    batch = tiny.random_batch(LENGTHS, seed=21)
    mask = batch.loss_mask.bool()
    diff = (result["log_probs"][mask] - tiny.hf_log_probs(hf_model, batch).detach()[mask]).abs()
    assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.15, (diff.mean(), diff.max())
    assert result["compile"]["graph_breaks"] == 0, result["compile"]["break_reasons"]


def _assert_compiled_equal_eager(result: dict) -> None:
    """bf16 log-probs and three steps' losses with and without the compiled layers, and
    no graph break (the inductor kernels keep float32 between fused operations, eager
    rounds each to bf16: measured on CPU <= 3e-3 in log-probs)."""
    assert result["compiled_layers"] == {"whole_layers": 2, "norms_only_layers": 0}
    assert result["compile"]["graph_breaks"] == 0, result["compile"]["break_reasons"]
    assert not result["compile"]["failures"]
    diff = (result["log_probs"] - result["eager"]["log_probs"]).abs()
    assert float(diff.mean()) < 5e-3 and float(diff.max()) < 0.05, (diff.mean(), diff.max())
    for got, expected in zip(result["losses"], result["eager"]["losses"], strict=True):
        assert got == pytest.approx(expected, rel=1e-2, abs=1e-2)
