"""GPU only: the loop with real SGLang servers (rl-sglang's SGLangServer), two steps each.

- one GPU, colocated, FSDP then Megatron: engine memory released while training and
  resumed for generation, weights by CUDA IPC;
- two GPUs, disaggregated: weights over an NCCL weight-update group (skipped with one GPU);
- two GPUs, colocated, one SGLang engine of tensor-parallel size 2 spanning both, trained by
  two FSDP ranks or by Megatron at TP=2 (skipped with one GPU).

Run on the GPU machine with SGLang on RL_SGLANG_PYTHONPATH (see examples/gpu/README.md):
``RL_SGLANG_PYTHONPATH=/tmp/sgsite python -m pytest -m gpu packages/rl-launcher/tests``.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from rl_launcher.config.loader import load_config
from rl_launcher.data.buffer import DataBuffer
from rl_launcher.loops.rl import run_step
from rl_launcher.session.start import start_run

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[3]
SHAPE = (
    "{model_type: qwen2, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 2,"
    " num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 512,"
    " max_position_embeddings: 512}"
)
SGLANG = [
    "--sglang-attention-backend",
    "triton",
    "--sglang-sampling-backend",
    "pytorch",
    "--sglang-grammar-backend",
    "none",
    "--sglang-skip-tokenizer-init",
    "--sglang-disable-cuda-graph",
]
MEAN_LOGPROB_GAP = 0.1  # bf16 SGLang kernels vs the bf16 trainer, same weights


def sglang_available() -> bool:
    path = os.environ.get("RL_SGLANG_PYTHONPATH", "")
    return any((Path(p) / "sglang").is_dir() for p in path.split(os.pathsep) if p) or (
        importlib.util.find_spec("sglang") is not None
    )


needs_sglang = pytest.mark.skipif(
    not sglang_available(), reason="SGLang missing: set RL_SGLANG_PYTHONPATH=/tmp/sgsite"
)


def gpu_run_args(
    run_dir: Path,
    *extra: str,
    config: str = "examples/quickstart/config.yaml",
    num_steps: int = 2,
    lr: str = "1e-3",
) -> list[str]:
    """rl-train's arguments for ``config`` on the GPU machine: the bf16 model of SHAPE,
    one SGLang engine at a third of the GPU's memory, small batches; ``extra`` last."""
    return [
        "--config",
        str(ROOT / config),
        "--num_steps",
        str(num_steps),
        "--optimizer.schedule",
        "constant",  # the Megatron backend trains at a constant lr
        "--cluster.device",
        "cuda",
        "--model.dtype",
        "bfloat16",
        "--model.init_config",
        SHAPE,
        "--model.tokenizer_path",
        str(ROOT / "examples/quickstart/tokenizer"),
        "--data.train.0.path",
        str(ROOT / "examples/quickstart/data/train.jsonl"),
        "--rollout.batch_size",
        "8",
        "--rollout.group_size",
        "4",
        "--rollout.max_response_tokens",
        "8",
        "--algorithm.num_minibatches",
        "1",
        "--optimizer.lr",
        lr,
        "--engine.kind",
        "sglang",
        "--engine.mem_fraction",
        "0.3",
        "--logging.run_dir",
        str(run_dir),
        *SGLANG,
        *extra,
    ]


def two_steps_reach_the_engine(args: list[str]) -> list[dict]:
    config, _ = load_config(args)
    run = start_run(config)
    try:
        buffer = DataBuffer.from_config(config, num_ranks=run.num_ranks)
        records = [run_step(run, buffer, step) for step in (1, 2)]
        assert run.rollout.engines.weight_versions() == ["2"]
    finally:
        run.close()
    assert [r["sync/weight_version"] for r in records] == [1.0, 2.0]
    assert [r["rollout/weight_version_min"] for r in records] == [0.0, 1.0]
    assert records[1]["mismatch/logprob_abs_diff_mean"] < MEAN_LOGPROB_GAP, records[1]
    return records


@needs_sglang
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_one_gpu_colocated_with_sglang_takes_turns(tmp_path, backend):
    records = two_steps_reach_the_engine(gpu_run_args(tmp_path / "run", "--backend.name", backend))
    assert records[1]["sync/bytes"] > 0


@needs_sglang
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_two_gpus_disaggregated_sync_over_nccl(tmp_path):
    two_steps_reach_the_engine(
        gpu_run_args(
            tmp_path / "run",
            "--cluster.colocate",
            "false",
            "--cluster.devices_per_node",
            "2",
            "--engine.mem_fraction",
            "0.6",
        )
    )


@needs_sglang
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_two_gpus_colocated_engine_of_tp_two(tmp_path, backend):
    run_dir = tmp_path / "run"
    extra = ["--backend.name", backend, "--cluster.devices_per_node", "2"]
    extra += ["--engine.devices_per_engine", "2"]
    if backend == "megatron":
        extra += ["--backend.tensor_parallel", "2"]
    records = two_steps_reach_the_engine(gpu_run_args(run_dir, *extra))
    assert records[1]["sync/bytes"] > 0
    server_logs = "".join(p.read_text() for p in run_dir.rglob("sglang-*.log"))
    assert "tp_size=2" in server_logs, "the engine did not start with SGLang tensor parallel 2"
