"""What the console says: ``--help`` of the console scripts, run as a user runs them
(subprocesses): exit 0, the option groups with their defaults, and where the full
descriptions are; the start-up note on float32 matmuls without TF32 on CUDA."""

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
    for shown_default in (
        " seed=42 ",
        " rollout.group_size=4 ",
        " rollout.reward=math ",
        " cluster.ray_address=null ",
        " optimizer.betas=[0.9, 0.999]",
    ):
        assert shown_default in text.replace("\n", " ") + " ", shown_default


def test_rl_plot_help_exits_0_and_bad_use_exits_2():
    shown = run("rl-plot", "--help")
    assert shown.returncode == 0 and shown.stdout.startswith("usage: rl-plot RUN_DIR")
    assert "RUN_DIR/plots" in shown.stdout
    wrong = run("rl-plot", "a", "b")
    assert wrong.returncode == 2 and wrong.stderr.strip() == "usage: rl-plot RUN_DIR"


def test_float32_on_cuda_without_tf32_is_noted_once_at_start_up(capsys):
    import torch

    from rl_launcher.session.model import precision_note

    config, before = TrainConfig(), torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")  # torch's default
        precision_note(config)  # CPU: nothing to say
        config.cluster.device = "cuda"
        precision_note(config)
        config.model.dtype = "bfloat16"
        precision_note(config)
        config.model.dtype = "float32"
        torch.set_float32_matmul_precision("high")  # TF32 on
        precision_note(config)
    finally:
        torch.set_float32_matmul_precision(before)
    (line,) = capsys.readouterr().err.splitlines()  # only float32 at "highest" on CUDA
    assert line.startswith("rl-train: note: model.dtype=float32: float32 matmuls on CUDA run")
    assert "TF32 off" in line and "model.dtype: bfloat16" in line
