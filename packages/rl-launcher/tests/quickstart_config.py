"""The quickstart config (examples/quickstart/config.yaml) as the integration runs use it:
paths made absolute, their own sections merged in, written to a folder of the run; the
PPO settings those runs share; a reward that pays part of an untrained model's answers."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "examples" / "quickstart"
# PPO with a critic (GAE) on 4 prompts x 4 samples, two minibatches, a fast critic
PPO = {
    "algorithm": {"advantage_estimator": "gae", "num_minibatches": 2, "lam": 0.95},
    "optimizer": {"lr": 0.01, "critic_lr": 0.01},
    "rollout": {"batch_size": 4, "group_size": 4},
}
# The untrained quickstart model never answers right; this pays about a third of its
# one-token answers, so rewards, returns and group advantages are not all equal.
VARIED_REWARD = """
def low_digit(response: str, label: str) -> float:
    return float(response.strip() in ("0", "1", "2", "3", "4"))
"""
LOW_DIGIT = "varied_rewards:low_digit"  # written beside every config (found there)


def write_config(directory: Path, *layers: dict) -> Path:
    """``directory/config.yaml``: the quickstart with each of ``layers``
    (``{section: {option: value}}``) merged in, section by section and in order; the
    varied reward's module (:data:`LOW_DIGIT`) beside it."""
    tree = yaml.safe_load((QUICKSTART / "config.yaml").read_text())
    tree["model"]["tokenizer_path"] = str(QUICKSTART / "tokenizer")
    tree["data"]["train"] = [{"path": str(QUICKSTART / "data/train.jsonl")}]
    for layer in layers:
        for section, values in layer.items():
            tree.setdefault(section, {}).update(values)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "varied_rewards.py").write_text(VARIED_REWARD)
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path
