"""``--help`` of the console scripts, run as a user runs them (subprocesses): exit 0, the
option groups with their defaults, and where the full descriptions are."""

import dataclasses
import subprocess
import sys
from pathlib import Path

from rl_launcher.config import TrainConfig


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    """The installed console script ``script`` (beside this Python)."""
    path = Path(sys.executable).with_name(script)
    return subprocess.run([str(path), *args], capture_output=True, text=True, timeout=120)


def test_rl_train_help_lists_every_group_and_option_with_its_default():
    shown = run("rl-train", "--help")
    assert shown.returncode == 0 and shown.stderr == ""
    text = shown.stdout
    assert text.startswith("usage: rl-train") and "docs/config.md" in text
    for flag in ("--config FILE", "--resume [STEP|PATH]", "--print-config", "--sglang-OPTION"):
        assert flag in text
    defaults = TrainConfig()
    for section in dataclasses.fields(TrainConfig):
        group = getattr(defaults, section.name)
        if not dataclasses.is_dataclass(group):
            continue
        assert f"\n{section.name}: " in text  # the group's header
        for option in dataclasses.fields(group):
            assert f" {section.name}.{option.name}=" in text, option.name
    for shown_default in (" seed=42 ", " rollout.group_size=4 ", " rollout.reward=math ",
                          " cluster.ray_address=null ", " optimizer.betas=[0.9, 0.999]"):  # fmt: skip
        assert shown_default in text.replace("\n", " ") + " ", shown_default


def test_rl_plot_help_exits_0_and_bad_use_exits_2():
    shown = run("rl-plot", "--help")
    assert shown.returncode == 0 and shown.stdout.startswith("usage: rl-plot RUN_DIR")
    assert "RUN_DIR/plots" in shown.stdout
    wrong = run("rl-plot", "a", "b")
    assert wrong.returncode == 2 and wrong.stderr.strip() == "usage: rl-plot RUN_DIR"
