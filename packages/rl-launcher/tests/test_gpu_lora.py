"""GPU only: LoRA adapters synced to a real SGLang engine (``model.lora_sync: adapter``).

rl-train's loop for three steps with rank-8 adapters (examples/quickstart/lora.yaml on the
bf16 model shape of test_gpu_backends.py), FSDP and one SGLang server colocated on one GPU.
The launcher starts SGLang with ``--enable-lora --max-lora-rank 8 --lora-target-modules
...`` (roles/lora.py) and keeps its base weights resident while training (only the KV cache
and CUDA graphs are released: the adapter sync never refills the base). Checked: each sync
loaded the new adapter (the engine reports version 3), the rollout log-probs SGLang computed
with ``lora_path`` agree with the trainer's, and after training a request without the
adapter scores the same tokens differently from one with it (the adapter is applied).

Run on the GPU machine as test_gpu_backends.py (see examples/gpu/README.md):
``RL_SGLANG_PYTHONPATH=/tmp/sgsite python -m pytest -m gpu packages/rl-launcher/tests/test_gpu_lora.py``.
"""

import asyncio

import pytest
from test_gpu_backends import MEAN_LOGPROB_GAP, gpu_run_args, needs_sglang

from rl_launcher.config.loader import load_config
from rl_launcher.data.buffer import DataBuffer
from rl_launcher.loops.rl import run_step
from rl_launcher.roles.lora import adapter_name
from rl_launcher.session.start import start_run

pytestmark = pytest.mark.gpu
STEPS = 3
PROBE_IDS = [3, 11, 5, 14, 7, 2, 9, 12, 4, 13, 6, 8]  # any ids: teacher-forced, not sampled
# mean |log-prob change| the trained adapter makes on PROBE_IDS at least (0.26 when the same
# three steps run on CPU: float32, embedded engine)
MIN_ADAPTER_EFFECT = 0.05
# rank 8 x (in + out) of each projection of SHAPE's 2 layers (hidden 256, k/v 128, MLP 512)
NUM_ADAPTER = 2 * 8 * (2 * (256 + 256) + 2 * (256 + 128) + 3 * (256 + 512))


def lora_run_args(run_dir, *extra: str) -> list[str]:
    """The LoRA quickstart on one GPU with a real SGLang engine; an entropy bonus and
    LoRA's usual ~10x lr move the adapters in three steps even where every sample of a
    group gets the same reward (no advantage)."""
    lora = ["--model.lora_rank", "8", "--model.lora_sync", "adapter"]
    lora += ["--algorithm.entropy_coef", "0.1", "--checkpoint.interval", "0"]
    return gpu_run_args(
        run_dir,
        *lora,
        *extra,
        config="examples/quickstart/lora.yaml",
        num_steps=STEPS,
        lr="1e-2",
    )


async def probe(url: str, adapter: str) -> tuple[list[float], list[float]]:
    """Teacher-forced log-probs of PROBE_IDS on one engine: with ``adapter``, then base."""
    from rl_sglang.client import EngineClient

    async with EngineClient(url, lora_path=adapter) as adapted:
        with_adapter = await adapted.prompt_logprobs(PROBE_IDS)
    async with EngineClient(url) as base:
        without = await base.prompt_logprobs(PROBE_IDS)
    return with_adapter, without


def three_lora_steps(args: list[str]) -> tuple[list[dict], list[str], list[float], list[float]]:
    """Run the steps; the engine's versions and its probe log-probs at the end."""
    config, _ = load_config(args)
    run = start_run(config)
    try:
        buffer = DataBuffer.from_config(config, num_ranks=run.num_ranks)
        records = [run_step(run, buffer, step) for step in range(1, STEPS + 1)]
        engines = run.rollout.engines
        versions = engines.weight_versions()
        adapted, base = asyncio.run(probe(engines.urls[0], adapter_name(STEPS)))
    finally:
        run.close()
    return records, versions, adapted, base


@needs_sglang
def test_lora_adapters_reach_a_real_sglang_engine_every_step(tmp_path):
    run_dir = tmp_path / "run"
    records, versions, adapted, base = three_lora_steps(lora_run_args(run_dir))
    server_logs = "".join(p.read_text() for p in run_dir.rglob("sglang-*.log"))
    assert "enable_lora=True" in server_logs and "max_lora_rank=8" in server_logs
    assert versions == [str(STEPS)]  # each sync loaded policy_v<N>, then set the version
    assert [r["sync/weight_version"] for r in records] == [1.0, 2.0, 3.0]
    assert [r["rollout/weight_version_min"] for r in records] == [0.0, 1.0, 2.0]
    # the adapters alone (bf16 or float32), not the merged weights
    assert all(r["sync/bytes"] in (2 * NUM_ADAPTER, 4 * NUM_ADAPTER) for r in records), records
    # steps 2 and 3 sampled with lora_path policy_v1 / v2: SGLang's base + adapter agrees
    # with the trainer's adapted model as closely as a full sync does
    for record in records:
        assert record["mismatch/logprob_abs_diff_mean"] < MEAN_LOGPROB_GAP, record
    assert len(adapted) == len(base) == len(PROBE_IDS) - 1
    effect = sum(abs(a - b) for a, b in zip(adapted, base, strict=True)) / len(base)
    assert effect > MIN_ADAPTER_EFFECT, (adapted, base)
