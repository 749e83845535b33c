"""slime's PPO switches end to end on CPU (real Ray, embedded engine, router, rl-fsdp
actor and critic): a two-step PPO run with a critic warm-up step, a tight value clip and
GAE advantages left unwhitened, dumping its rollouts; then a train-only replay of half of
each dump. Each effect is read back from metrics.jsonl and the train-batch dumps."""

from pathlib import Path

import pytest
import torch
import yaml

from rl_launcher.cli import main
from rl_launcher.infra.run_log import read_metrics

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "examples" / "quickstart"
PPO = {
    "algorithm": {
        "advantage_estimator": "gae",
        "num_minibatches": 2,
        "lam": 0.95,
        "critic_warmup_steps": 1,
        "value_clip": 0.001,
        "normalize_advantages": False,
    },
    "optimizer": {"lr": 0.01, "critic_lr": 0.01},
    "rollout": {"batch_size": 4, "group_size": 4, "reward": "switch_rewards:low_digit"},
    "logging": {"dump_train_batch": True},
}
# About a third of the untrained model's one-token answers are paid: rewards differ.
VARIED_REWARD = """
def low_digit(response: str, label: str) -> float:
    return float(response.strip() in ("0", "1", "2", "3", "4"))
"""


def config_file(root: Path) -> Path:
    tree = yaml.safe_load((QUICKSTART / "config.yaml").read_text())
    tree["model"]["tokenizer_path"] = str(QUICKSTART / "tokenizer")
    tree["data"]["train"] = [{"path": str(QUICKSTART / "data/train.jsonl")}]
    for section, values in PPO.items():
        tree.setdefault(section, {}).update(values)
    root.mkdir(parents=True, exist_ok=True)
    (root / "switch_rewards.py").write_text(VARIED_REWARD)  # found beside the config
    (root / "config.yaml").write_text(yaml.safe_dump(tree))
    return root / "config.yaml"


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
