"""Every example config loads and validates, and the data files it names exist."""

from pathlib import Path

import pytest

from rl_launcher.config.loader import load_config
from rl_launcher.data.reader import parse_spec

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = sorted((ROOT / "examples").glob("*/*.yaml"))


def test_examples_are_found():
    names = {path.parent.name for path in CONFIGS}
    assert {"quickstart", "ppo", "sft_then_grpo", "multiturn"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_example_config_validates_and_its_files_exist(path):
    config, _ = load_config(["--config", str(path)])
    assert (path.parent / "README.md").is_file(), "every example has a README"
    for spec in [*config.data.train, *config.eval.datasets]:
        assert (ROOT / parse_spec(spec.path)[0]).is_file(), spec.path
    if config.model.tokenizer_path is not None:
        assert (ROOT / config.model.tokenizer_path).is_dir()
