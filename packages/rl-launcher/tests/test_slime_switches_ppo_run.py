"""slime's PPO switches end to end on CPU (real Ray, embedded engine, router, rl-fsdp
actor and critic): a two-step PPO run with a critic warm-up step, a tight value clip and
GAE advantages left unwhitened, dumping its rollouts; then a train-only replay of half of
each dump. Each effect is read back from metrics.jsonl and the train-batch dumps."""

from pathlib import Path

import pytest
import torch
from quickstart_config import LOW_DIGIT, PPO, write_config

from rl_launcher.cli import main
from rl_launcher.infra.run_log import read_metrics

pytestmark = pytest.mark.integration
SWITCHES = {
    "algorithm": {"critic_warmup_steps": 1, "value_clip": 0.001, "normalize_advantages": False},
    "rollout": {"reward": LOW_DIGIT},  # rewards differ
    "logging": {"dump_train_batch": True},
}


def config_file(root: Path) -> Path:
    return write_config(root, PPO, SWITCHES)


@pytest.fixture(scope="module")
def root(ray_cluster, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ppo_switches")
    args = ["--config", str(config_file(root)), "--num_steps", "2"]
    assert (
        main(
            [
                *args,
                "--logging.run_dir",
                str(root / "run"),
                "--rollout.dump_dir",
                str(root / "dumps"),
            ]
        )
        == 0
    )
    return root


def test_the_first_step_trains_only_the_critic(root):
    first, second = read_metrics(root / "run")
    assert first["actor/frozen_for_critic_warmup"] == 1.0 and "loss/pg" not in first
    assert first["loss/value"] > 0
    assert "actor/frozen_for_critic_warmup" not in second and "loss/pg" in second


def test_a_tight_value_clip_clips(root):
    """critic/clipfrac (the last minibatch's, after one critic update) is the share of
    tokens whose clipped error is the larger; without a clip it is always 0."""
    assert max(record["critic/clipfrac"] for record in read_metrics(root / "run")) > 0


def test_gae_advantages_are_left_unwhitened(root):
    (batch,) = torch.load(root / "run/train_batches/step_000001.pt")["rank_batches"]
    advantages = batch["advantages"][batch["loss_mask"] > 0]
    assert abs(float(advantages.mean())) > 1e-3 or abs(float(advantages.std()) - 1) > 1e-3


def test_a_replay_trains_on_half_of_each_dump(root):
    args = ["--config", str(config_file(root / "replay")), "--num_steps", "2"]
    replay = ["--rollout.replay_dir", str(root / "dumps"), "--rollout.replay_fraction", "0.5"]
    assert main([*args, *replay, "--logging.run_dir", str(root / "replay/run")]) == 0
    for record in read_metrics(root / "replay/run"):
        assert record["train/num_samples"] == 8.0  # 2 of the dump's 4 groups of 4
