"""PPO with its critic on Megatron end to end on CPU (real Ray, embedded engine, router,
rl-megatron actor and critic on two pipeline stages, the critic's value head on the last
one, CPU shim): two steps, the critic trained on GAE returns and checkpointed beside the
trainer. (TP=2 + SP critics are checked against one rank in rl-megatron's tests.)"""

from pathlib import Path

import pytest
import torch
from quickstart_config import LOW_DIGIT, PPO, write_config

from rl_launcher.cli import main
from rl_launcher.infra.run_log import read_metrics

pytestmark = pytest.mark.integration
ON_MEGATRON = {
    "rollout": {"reward": LOW_DIGIT},  # returns differ
    "backend": {"name": "megatron", "pipeline_parallel": 2},
    "cluster": {"devices_per_node": 2},
    "logging": {"dump_train_batch": True},
}


@pytest.fixture(scope="module")
def root(ray_cluster, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron_ppo")
    args = ["--config", str(write_config(root, PPO, ON_MEGATRON)), "--num_steps", "2"]
    assert main([*args, "--logging.run_dir", str(root / "run")]) == 0
    return root


def test_the_megatron_critic_learns_the_returns(root):
    first, second = read_metrics(root / "run")
    assert first["loss/value"] > 0 and second["loss/value"] > 0
    assert "loss/pg" in first and "critic/clipfrac" in second
    # the value head starts at zero: step 1's old values are 0, step 2's come from the
    # critic trained on step 1's returns
    (step1,) = torch.load(root / "run/train_batches/step_000001.pt")["rank_batches"]
    (step2,) = torch.load(root / "run/train_batches/step_000002.pt")["rank_batches"]
    assert torch.count_nonzero(step1["old_values"]) == 0
    assert torch.count_nonzero(step2["old_values"][step2["loss_mask"] > 0]) > 0
