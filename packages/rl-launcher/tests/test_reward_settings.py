"""The run's reward options reach rl-sglang's rollout, whose guard (tested with real
engines in rl-sglang's test_reward_faults.py) times out hung rewards and catches NaN/inf."""

import pytest
from test_train_loop import ROOT, shrunk

from rl_launcher.config_loader import load_config
from rl_launcher.run.model_setup import load_tokenizer
from rl_launcher.run.rollout_manager import RolloutManager


@pytest.mark.parametrize(("on_error", "timeout", "guard_mode", "guard_timeout"),
                         [([], [], "raise", 60.0),
                          (["--rollout.on_reward_error", "skip"],
                           ["--rollout.reward_timeout_s", "2.5"], "drop", 2.5)])  # fmt: skip
def test_reward_failures_are_handled_as_configured(tmp_path, on_error, timeout, guard_mode,
                                                   guard_timeout):  # fmt: skip
    config, _ = load_config(shrunk(tmp_path / "run", *on_error, *timeout))
    tokenizer = load_tokenizer(ROOT / "examples/quickstart/tokenizer")
    manager = RolloutManager(config, model_dir=tmp_path, tokenizer=tokenizer, source=None,
                             log_dir=tmp_path)  # fmt: skip
    try:
        settings = manager.rollout_settings(num_groups=4)
    finally:
        manager.stop()
    assert settings.reward_on_error == guard_mode
    assert settings.reward_timeout_s == guard_timeout
    assert settings.num_groups == 4 and settings.n_samples_per_prompt == config.rollout.group_size
