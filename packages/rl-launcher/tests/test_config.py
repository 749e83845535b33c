"""Config tree: YAML + overrides, passthrough, validation messages, --print-config."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rl_launcher.cli import main
from rl_launcher.config import TrainConfig
from rl_launcher.config.loader import (
    config_from_tree,
    config_to_yaml,
    load_config,
    parse_command_line,
)


def test_defaults_are_the_cpu_quickstart():
    config, _ = load_config([])
    assert config == TrainConfig()
    assert (config.cluster.device, config.engine.kind, config.backend.name) == (
        "cpu",
        "embedded",
        "fsdp",
    )
    assert config.algorithm.advantage_estimator == "grpo"
    assert config.model.path is None and config.model.init_config["hidden_size"] == 64


def test_yaml_then_both_override_syntaxes(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 7\nalgorithm:\n  advantage_estimator: dr_grpo\n  kl_coef: 0.1\n")
    config, _ = load_config(
        [
            "--config",
            str(path),
            "--algorithm.advantage_estimator",
            "rloo",
            "rollout.group_size=2",
            "--optimizer.lr=1e-5",
            "--rollout.top_k",
            "-1",
            "--algorithm.clip-high",
            "0.28",
        ]
    )
    assert config.seed == 7 and config.algorithm.kl_coef == 0.1  # from the file
    assert config.algorithm.advantage_estimator == "rloo"  # the command line wins
    assert config.rollout.group_size == 2 and config.optimizer.lr == 1e-5
    assert config.rollout.top_k == -1 and config.algorithm.clip_high == 0.28


def test_list_items_and_nested_values_override(tmp_path):
    config, _ = load_config(
        [
            "data.train=[{path: a.jsonl, weight: 2}, {path: 'b.parquet@[0:10]'}]",
            "data.train.1.prompt_key=question",
            "eval.pass_k=[1, 2]",
            "eval.samples_per_prompt=4",
        ]
    )
    assert [d.path for d in config.data.train] == ["a.jsonl", "b.parquet@[0:10]"]
    assert config.data.train[0].weight == 2.0 and config.data.train[1].prompt_key == "question"
    assert config.eval.pass_k == [1, 2]


def test_passthrough_options_are_kept_verbatim():
    config, command_line = load_config(
        [
            "--sglang-mem-fraction-static",
            "0.7",
            "--sglang-enable-torch-compile",
            "--algorithm.kl_coef",
            "0.2",
            "--sglang-log-level=warning",
            "--megatron-recompute-granularity",
            "full",
            "--print-config",
        ],
        flags=("--print-config",),
    )
    assert config.engine.sglang_args == [
        "--sglang-mem-fraction-static",
        "0.7",
        "--sglang-enable-torch-compile",
        "--sglang-log-level=warning",
    ]
    assert config.backend.extra_args == ["--megatron-recompute-granularity", "full"]
    assert config.algorithm.kl_coef == 0.2 and command_line.flags == {"--print-config"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--algorithm.advantage_estimator", "foo"],
            "algorithm.advantage_estimator: 'foo' is not allowed; choose one of: dr_grpo, gae, grpo, "
            "reinforce_plus_plus, reinforce_plus_plus_baseline, rloo",
        ),
        (["--algorithm.policy_loss", "ppo2"], "choose one of: cispo, gspo, ppo"),
        (["--algorithm.group_filter", "x"], "algorithm.group_filter: 'x' is not allowed"),
        (["--algorithm.kl_kind", "k4"], "choose one of: k1, k2, k3, low_var_kl"),
        (["--algorithm.kl_cof", "1"], "unknown option 'algorithm.kl_cof'; did you mean 'kl_coef'?"),
        (["--algorithmm.kl_coef", "1"], "unknown option 'algorithmm'; did you mean 'algorithm'?"),
        (["--rollout.batch_size", "eight"], "rollout.batch_size: expected int, got 'eight' (str)"),
        (["--rollout.batch_size", "2.5"], "rollout.batch_size: expected int, got 2.5"),
        (["--cluster.colocate", "maybe"], "cluster.colocate: expected bool"),
        (["--backend.num_ranks", "all"], "backend.num_ranks: expected int or null, got 'all'"),
        (["--rollout.batch_size", "0"], "rollout.batch_size: must be >= 1, got 0"),
        (["--data.train", "[{weight: 1}]"], "missing required option data.train[0].path"),
        (["--data.train", "[{path: a.jsonl, colum: x}]"], "unknown option 'data.train[0].colum'"),
        (["--algorithm", "3"], "algorithm: expected a mapping of options"),
        (
            ["--algorithm.advantage_estimator", "rloo", "--rollout.group_size", "1"],
            "needs rollout.group_size >= 2",
        ),
        (["--engine.num_engines", "2"], "cluster has 1 devices"),
        (["--engine.kind", "sglang"], "engine.kind=sglang needs cluster.device=cuda"),
        (["--eval.pass_k", "[4]"], "every k must be in 1..eval.samples_per_prompt"),
        (
            ["--rollout.source", "buffer", "--rollout.loop", "async"],
            "rollout.source=buffer trains on the groups agent workers write, so rollout.loop=async",
        ),
        (
            ["--rollout.source", "buffer", "--rollout.buffer_min_ratio", "0"],
            "rollout.buffer_min_ratio: must be > 0",
        ),
        (["--config", "/nonexistent.yaml"], "config file '/nonexistent.yaml' does not exist"),
        (["--seed"], "option --seed needs a value"),
        (["positional"], "unrecognised argument 'positional'"),
    ],
)
def test_bad_input_names_the_field_and_the_allowed_values(argv, message):
    with pytest.raises(ValueError) as error:
        load_config(argv)
    assert message in str(error.value)


def test_print_config_round_trips(capsys):
    argv = [
        "--algorithm.advantage_estimator",
        "rloo",
        "--sglang-mem-fraction-static",
        "0.7",
        "--print-config",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    reloaded = config_from_tree(yaml.safe_load(printed))
    expected, _ = load_config(argv, flags=("--print-config",))
    assert reloaded == expected and config_to_yaml(reloaded) == printed
    assert dataclasses.asdict(reloaded)["engine"]["sglang_args"] == [
        "--sglang-mem-fraction-static",
        "0.7",
    ]


def test_unwired_modes_and_bad_options_fail_with_a_message(capsys):
    assert main(["--rollout.loop", "async", "--rollout.replay_dir", "dumps"]) == 2
    assert "a replay has no generation: use rollout.loop=sync" in capsys.readouterr().err
    assert main(["--num_steps", "zero"]) == 2
    assert "num_steps: expected int" in capsys.readouterr().err
    assert main(["--algorithm.advantage_estimator", "grpoo"]) == 2
    error = capsys.readouterr().err
    assert "algorithm.advantage_estimator" in error and "grpo" in error
    assert main(["--rollout.temprature", "1.0"]) == 2
    assert "did you mean 'temperature'" in capsys.readouterr().err


def test_passthrough_value_boundaries():
    parsed = parse_command_line(
        ["--sglang-a=1", "--sglang-flag", "rollout.top_k=5", "--sglang-b", "2", "--megatron-c"]
    )
    assert parsed.passthrough[("engine", "sglang_args")] == [
        "--sglang-a=1",
        "--sglang-flag",
        "--sglang-b",
        "2",
    ]
    assert parsed.passthrough[("backend", "extra_args")] == ["--megatron-c"]
    assert parsed.overrides == [("rollout.top_k", "5")]
    with pytest.raises(ValueError, match="unrecognised argument 'x'"):
        parse_command_line(["--sglang-a=1", "x"])  # a value given with = takes no second token


def test_flags_are_not_overrides():
    parsed = parse_command_line(
        ["--print-config", "-c", "x.yaml", "a.b=1"], flags=("--print-config",)
    )
    assert parsed.flags == {"--print-config"} and parsed.config_path == "x.yaml"
    assert parsed.overrides == [("a.b", "1")]


def test_console_script_prints_the_resolved_config(tmp_path):
    script = Path(sys.executable).parent / "rl-train"
    assert script.is_file(), "rl-train console script is not installed"
    run = subprocess.run(
        [str(script), "--print-config", "--rollout.loop", "one_step_async"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert yaml.safe_load(run.stdout)["rollout"]["loop"] == "one_step_async"
    bad = subprocess.run(
        [str(script), "--rollout.loop", "fast"], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2
    assert (
        "rollout.loop: 'fast' is not allowed; choose one of: sync, one_step_async, async"
        in bad.stderr
    )
