"""The "dpo" objective on FSDPBackend: pairs stay whole in micro-batches, the step's loss
is rl_core's packed_pair_loss of the whole batch, and training on pairs raises the margin."""

import pytest
import torch
import torch.distributed as dist
from fsdp_tiny import CONFIGS, tokens_batch

from rl_core.distributed import free_port
from rl_core.objective import Objective
from rl_core.preference import packed_pair_loss
from rl_fsdp import FSDPBackend, FSDPConfig

# five pairs: (9, 17), (5, 12), (20, 8), (14, 11), (16, 6) tokens; with a 30-token budget
# no two pairs fit together, while a per-sequence first-fit would split pairs
OBJECTIVE = Objective(mode="dpo", dpo_beta=0.5)


@pytest.fixture(scope="module")
def group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def start(budget: int) -> FSDPBackend:
    config = FSDPConfig(
        model_config=CONFIGS["qwen2"],
        device="cpu",
        lr=1e-2,
        objective=OBJECTIVE,
        max_tokens_per_micro_batch=budget,
    )
    return FSDPBackend.start(
        config, rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port()
    )


def pair_batch(backend):
    batch = tokens_batch().with_global_denominators()
    noise = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(3))
    batch.ref_log_probs = backend.compute_log_probs(batch, model="ref") + 0.2 * noise
    return batch


def test_pairs_stay_whole_and_the_loss_is_the_whole_batch_loss(group):
    small, large = start(budget=30), start(budget=4096)
    assert small.ref_model is not None  # dpo loads the reference
    batch = pair_batch(small)
    plan = small.plan(batch, 30)
    assert sorted(plan) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    expected, metrics = packed_pair_loss(
        log_probs=small.compute_log_probs(batch),
        ref_log_probs=batch.ref_log_probs,
        mask=batch.loss_mask,
        cu_seqlens=batch.cu_seqlens,
        num_pairs=5,
        beta=0.5,
    )
    for backend in (small, large):
        step = backend.train_step(batch)
        assert step["pref/loss"] == pytest.approx(float(expected), rel=1e-5)
        assert step["loss/total"] == pytest.approx(float(expected), rel=1e-5)
        assert step["pref/accuracy"] == pytest.approx(metrics["pref/accuracy"], abs=1e-6)
        assert step["pref/margin"] == pytest.approx(metrics["pref/margin"], rel=1e-4)


def test_steps_on_pairs_raise_accuracy_and_margin(group):
    backend = start(budget=30)
    batch = pair_batch(backend)
    steps = [backend.train_step(batch) for _ in range(6)]
    assert steps[0]["pref/accuracy"] < 1.0
    assert steps[-1]["pref/accuracy"] == pytest.approx(1.0)
    assert steps[-1]["pref/margin"] > steps[0]["pref/margin"] + 1.0
    assert steps[-1]["pref/loss"] < 0.5 * steps[0]["pref/loss"]
