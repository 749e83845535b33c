"""PPO with its critic on Megatron end to end on CPU (real Ray, embedded engine, router,
rl-megatron actor and critic on two pipeline stages, the critic's value head on the last
one, CPU shim): two steps, the critic trained on GAE returns and checkpointed beside the
trainer. (TP=2 + SP critics are checked against one rank in rl-megatron's tests.)"""

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
    "algorithm": {"advantage_estimator": "gae", "num_minibatches": 2, "lam": 0.95},
    "optimizer": {"lr": 0.01, "critic_lr": 0.01},
    "rollout": {"batch_size": 4, "group_size": 4, "reward": "critic_rewards:low_digit"},
    "backend": {"name": "megatron", "pipeline_parallel": 2},
    "cluster": {"devices_per_node": 2},
    "logging": {"dump_train_batch": True},
}
# About a third of the untrained model's one-token answers are paid: returns differ.
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
    (root / "critic_rewards.py").write_text(VARIED_REWARD)  # found beside the config
    (root / "config.yaml").write_text(yaml.safe_dump(tree))
    return root / "config.yaml"


@pytest.fixture(scope="module")
def root(ray_cluster, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron_ppo")
    args = ["--config", str(config_file(root)), "--num_steps", "2"]
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
