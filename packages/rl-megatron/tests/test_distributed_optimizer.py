"""``use_distributed_optimizer`` (megatron-core's name; ZeRO-1 over data-parallel ranks here)
at DP=2 on two gloo ranks: each rank keeps half of the AdamW state, and two steps with a
warm-up / cosine schedule give the same losses and weights as the replicated optimizer."""

import pytest
import tiny
import torch
from dist_job import LENGTHS
from multi_rank import spawn_gloo

from rl_core.objective import Objective

pytestmark = pytest.mark.integration
SCHEDULE = dict(warmup_steps=1, lr_decay="cosine", total_steps=3, min_lr_ratio=0.1)


def two_steps(hf_path: str, rank: int, distributed: bool) -> dict:
    from rl_megatron import optim
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    config = MegatronConfig(
        hf_path=hf_path,
        device="cpu",
        lr=1e-3,
        objective=Objective(entropy_coef=0.01),
        megatron={"use_distributed_optimizer": distributed},
        **SCHEDULE,
    )
    backend = MegatronBackend(config)
    full = tiny.random_batch(LENGTHS, seed=11)
    shard = full.select([0, 3] if rank == 0 else [1, 2])
    metrics = [backend.train_step(shard) for _ in range(2)]
    local = optim.local_optimizer(backend.optimizer)
    return {
        "metrics": metrics,
        "weights": dict(p for b in backend.export_weights(bucket_bytes=1 << 20) for p in b),
        "state_params": sum(len(g["params"]) for g in local.param_groups),
        "num_params": len(backend.params),
    }


def both_optimizers(rank: int, hf_path: str) -> dict[bool, dict]:
    """``two_steps`` with the replicated optimizer (False), then the distributed (True)."""
    return {flag: two_steps(hf_path, rank, flag) for flag in (False, True)}


def test_distributed_optimizer_equals_the_replicated_one_at_dp2(model_dirs, tmp_path):
    hf_path = str(model_dirs["qwen3"][0])
    results = spawn_gloo(both_optimizers, 2, tmp_path / "results.pt", hf_path)
    replicated, sharded = results[False], results[True]
    assert replicated["state_params"] == replicated["num_params"]
    assert 0 < sharded["state_params"] < sharded["num_params"]  # this rank's half
    for got, expected in zip(sharded["metrics"], replicated["metrics"], strict=True):
        for key in ("loss/total", "train/grad_norm", "train/lr"):
            assert got[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-7), key
    assert [m["train/lr"] for m in sharded["metrics"]] == pytest.approx([1e-3, 1e-3])
    for name, weight in replicated["weights"].items():
        torch.testing.assert_close(sharded["weights"][name], weight, atol=1e-6, rtol=1e-5)
