"""Wrong set-ups fail in seconds, before Ray starts, with exit status 2 and one line naming
the option: option bounds, group-relative estimators with groups of one, missing GPUs,
malformed YAML, unwritable run directories and a Ray address where nothing answers."""

import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

from rl_core.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs
from rl_launcher import cli
from rl_launcher.config.checks import GROUP_RELATIVE_ESTIMATORS, KL_BLIND_ESTIMATORS
from rl_launcher.config.loader import load_config
from rl_launcher.infra import ray_cluster
from rl_launcher.infra.ray_cluster import check_reachable
from rl_launcher.infra.run_dirs import prepare_run_dirs
from rl_launcher.session.run import check_fresh

QUICKSTART_DIR = Path(__file__).resolve().parents[3] / "examples" / "quickstart"
TOKENIZER = QUICKSTART_DIR / "tokenizer"
TRAIN_DATA = f"[{{path: {QUICKSTART_DIR / 'data' / 'train.jsonl'}}}]"  # wherever pytest runs


def _must_not_start(config):
    raise AssertionError("the run started although the set-up is wrong")


@pytest.fixture
def guarded(monkeypatch):
    """``cli.main`` whose run never starts: a check that lets a wrong set-up through
    fails the test at once instead of starting Ray (early, beside the loop's start-up:
    ``ray_cluster.start_early``) and training."""
    monkeypatch.setattr(cli, "run_mode", lambda config: _must_not_start)
    monkeypatch.setattr(ray_cluster, "start_early", _must_not_start)
    return cli.main


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("rl-train: error: ") and err.count("\n") == 1, err
    return err


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- 3. every bound the runtime enforces, refused while the config is read ---------------

OUT_OF_RANGE = [
    ("optimizer.lr", "0"),
    ("optimizer.lr", "-1e-4"),
    ("optimizer.lr", "nan"),
    ("optimizer.lr", ".inf"),
    ("optimizer.critic_lr", "0"),
    ("optimizer.betas", "[0.9, 1.0]"),
    ("optimizer.betas", "[-0.1, 0.99]"),
    ("optimizer.betas", "[0.9]"),
    ("optimizer.eps", "0"),
    ("optimizer.weight_decay", "-0.01"),
    ("optimizer.grad_clip", "-1"),
    ("optimizer.grad_clip", "nan"),
    ("optimizer.warmup_steps", "-1"),
    ("optimizer.min_lr_ratio", "1.5"),
    ("algorithm.clip_low", "-0.1"),
    ("algorithm.clip_high", "-0.1"),
    ("algorithm.dual_clip", "1.0"),
    ("algorithm.kl_coef", "-0.1"),
    ("algorithm.entropy_coef", "-0.1"),
    ("algorithm.gamma", "1.5"),
    ("algorithm.lam", "-0.5"),
    ("algorithm.rollout_is_cap", "0"),
    ("algorithm.num_minibatches", "0"),
    ("algorithm.max_nonfinite_steps", "-1"),
    ("rollout.batch_size", "0"),
    ("rollout.group_size", "0"),
    ("rollout.max_response_tokens", "0"),
    ("rollout.temperature", "-0.5"),
    ("rollout.temperature", "nan"),
    ("rollout.top_p", "0"),
    ("rollout.top_p", "1.01"),
    ("rollout.top_k", "0"),
    ("rollout.top_k", "-2"),
    ("rollout.max_staleness", "-1"),
    ("rollout.over_sampling", "0.5"),
    ("rollout.reward_timeout_s", "0"),
    ("rollout.reward_timeout_s", "-5"),
    ("engine.num_engines", "0"),
    ("engine.devices_per_engine", "0"),
    ("engine.mem_fraction", "0"),
    ("engine.mem_fraction", "1.5"),
    ("engine.weight_bucket_bytes", "0"),
    ("engine.sync_every", "0"),
    ("engine.health_interval_s", "-1"),
    ("engine.health_timeout_s", "0"),
    ("engine.max_restarts", "-1"),
    ("cluster.num_nodes", "0"),
    ("cluster.devices_per_node", "0"),
    ("cluster.cpus_per_bundle", "0"),
    ("cluster.connect_timeout_s", "0"),
    ("backend.num_ranks", "0"),
    ("backend.micro_batch_tokens", "0"),
    ("backend.tensor_parallel", "0"),
    ("data.max_prompt_tokens", "0"),
    ("data.read_batch_rows", "0"),
    ("eval.samples_per_prompt", "0"),
    ("eval.temperature", "-1"),
    ("eval.max_response_tokens", "0"),
    ("eval.pass_k", "[0]"),
    ("eval.interval", "-1"),
    ("checkpoint.interval", "-1"),
    ("checkpoint.keep_last", "0"),
    ("num_steps", "0"),
    ("seed", "-1"),
    ("seed", str(2**32)),
]


@pytest.mark.parametrize(("option", "value"), OUT_OF_RANGE)
def test_an_option_out_of_range_exits_2_naming_it(option, value, guarded, capsys):
    assert guarded([f"--{option}", value, "--print-config"]) == 2  # 0 if it were accepted
    assert f"rl-train: error: {option}" in _error_line(capsys)


def test_the_bounds_say_what_is_allowed(capsys):
    expected = {
        ("optimizer.lr", "0"): "optimizer.lr: must be > 0, got 0.0",
        ("optimizer.lr", "nan"): "optimizer.lr: must be a finite number, got nan",
        (
            "optimizer.betas",
            "[0.9, 1.0]",
        ): "optimizer.betas must be two numbers in [0, 1), got [0.9, 1.0]",
        ("rollout.top_p", "1.01"): "rollout.top_p: must be <= 1, got 1.01",
        ("rollout.reward_timeout_s", "0"): "rollout.reward_timeout_s: must be > 0, got 0.0",
        ("rollout.top_k", "0"): "rollout.top_k=0 is not a way to turn top-k off here",
        ("rollout.top_k", "-2"): "rollout.top_k must be -1 (off) or a k >= 1, got -2",
    }
    for (option, value), message in expected.items():
        with pytest.raises(ValueError) as error:
            load_config([f"--{option}", value])
        assert message in str(error.value)
        if (option, value) == ("rollout.top_k", "0"):
            assert "write -1 for off" in str(error.value)


def test_values_on_the_bounds_are_accepted():
    config, _ = load_config(
        [
            "--optimizer.betas",
            "[0.0, 0.5]",
            "--optimizer.grad_clip",
            "0",
            "--rollout.top_p",
            "1",
            "--rollout.top_k",
            "1",
            "--rollout.temperature",
            "0",
            "--algorithm.gamma",
            "1",
            "--optimizer.min_lr_ratio",
            "1",
            "--engine.mem_fraction",
            "1",
            "--seed",
            "0",
            "--rollout.reward_timeout_s",
            "null",
            "--algorithm.dual_clip",
            "1.5",
        ]
    )
    assert config.optimizer.betas == [0.0, 0.5] and config.rollout.top_k == 1
    assert config.rollout.reward_timeout_s is None and config.algorithm.dual_clip == 1.5


# --- 2. group-relative advantages need groups of two or more -----------------------------


@pytest.mark.parametrize("estimator", GROUP_RELATIVE_ESTIMATORS)
def test_group_relative_estimator_refuses_groups_of_one(estimator, guarded, capsys):
    argv = ["--algorithm.advantage_estimator", estimator, "--rollout.group_size", "1"]
    assert guarded([*argv, "--print-config"]) == 2
    error = _error_line(capsys)
    assert f"algorithm.advantage_estimator={estimator} needs rollout.group_size >= 2" in error


def test_groups_of_one_are_fine_where_nothing_is_group_relative():
    for argv in (
        ["--algorithm.advantage_estimator", "reinforce_plus_plus"],
        ["--rollout.rollout_only", "true"],
        ["--mode", "sft"],
    ):
        config, _ = load_config([*argv, "--rollout.group_size", "1"])
        assert config.rollout.group_size == 1


def test_group_relative_list_matches_the_estimators():
    """An estimator is listed iff it gives a group of one zero advantages (or refuses it),
    so a new estimator in rl_core cannot slip past the check."""
    rewards, mask = torch.tensor([1.0, 0.0, 3.0]), torch.ones(3, 4)
    for name in ADVANTAGE_ESTIMATORS.names():
        inputs = AdvantageInputs(rewards=rewards, mask=mask, group_size=1, values=torch.zeros(3, 4))
        try:
            advantages, _ = ADVANTAGE_ESTIMATORS.get(name)(inputs)
            learns = bool(advantages.abs().max() > 0)
        except ValueError:
            learns = False
        assert learns == (name not in GROUP_RELATIVE_ESTIMATORS), name


@pytest.mark.parametrize("estimator", KL_BLIND_ESTIMATORS)
def test_reward_kl_is_refused_where_the_estimator_ignores_it(estimator, guarded, capsys):
    argv = ["--algorithm.advantage_estimator", estimator, "--algorithm.reward_kl_coef", "0.1"]
    assert guarded([*argv, "--print-config"]) == 2
    error = _error_line(capsys)
    assert (
        f"algorithm.reward_kl_coef=0.1 has no effect with algorithm.advantage_estimator={estimator}"
        in error
    )


def test_reward_kl_is_taken_where_the_estimator_reads_it():
    for estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"):
        argv = ["--algorithm.advantage_estimator", estimator, "--algorithm.reward_kl_coef", "0.1"]
        config, _ = load_config(argv)
        assert config.algorithm.reward_kl_coef == 0.1 and config.algorithm.reward_kl_kind == "k1"


def test_kl_blind_list_matches_the_estimators():
    """An estimator is listed iff filling AdvantageInputs.kl leaves its advantages as they
    were, so a new estimator in rl_core cannot slip past the check."""
    rewards, mask = torch.tensor([1.0, 0.0, 3.0, 0.5]), torch.ones(4, 3)
    kl = torch.tensor([[0.3, -0.1, 0.2], [0.0, 0.4, 0.1], [0.2, 0.2, -0.3], [0.1, 0.0, 0.5]])
    for name in ADVANTAGE_ESTIMATORS.names():
        estimator = ADVANTAGE_ESTIMATORS.get(name)
        common = dict(rewards=rewards, mask=mask, group_size=2, values=torch.zeros(4, 3))
        without, _ = estimator(AdvantageInputs(**common))
        with_kl, _ = estimator(AdvantageInputs(**common, kl=kl, kl_coef=0.5))
        blind = torch.equal(without, with_kl)
        assert blind == (name in KL_BLIND_ESTIMATORS), name


# --- 1. GPUs checked before Ray starts ---------------------------------------------------


def _gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_cuda_without_gpus_exits_2_before_ray(tmp_path, guarded, monkeypatch, capsys):
    _gpus(monkeypatch, 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    started = time.monotonic()
    assert guarded(["--cluster.device", "cuda", "--logging.run_dir", str(tmp_path)]) == 2
    error = _error_line(capsys)
    assert "cluster.device=cuda: the placement needs 1 GPU(s)" in error
    assert "torch sees 0 (torch.cuda.is_available() is False" in error
    assert time.monotonic() - started < 10 and not _ray_running()


def test_cuda_with_too_few_gpus_names_the_layout(tmp_path, guarded, monkeypatch, capsys):
    _gpus(monkeypatch, 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    argv = [
        "--cluster.device",
        "cuda",
        "--cluster.devices_per_node",
        "4",
        "--model.tokenizer_path",  # a run that could start: the tiny model of the quickstart
        str(TOKENIZER),
        "--data.train",
        TRAIN_DATA,
        "--logging.run_dir",
        str(tmp_path),
    ]
    assert guarded(argv) == 2
    assert "needs 4 GPU(s) on this machine" in _error_line(capsys)
    _gpus(monkeypatch, 4)  # enough: the run would start (here: the guard stops it)
    with pytest.raises(AssertionError, match="the run started"):
        guarded(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_on_this_cpu_machine_exits_2(tmp_path, capsys):
    assert cli.main(["--cluster.device", "cuda", "--logging.run_dir", str(tmp_path)]) == 2
    assert "cluster.device=cuda" in _error_line(capsys) and not _ray_running()


def test_attached_to_a_cluster_the_drivers_gpus_do_not_matter(
    tmp_path, guarded, monkeypatch, capsys
):
    _gpus(monkeypatch, 0)
    address = f"127.0.0.1:{_closed_port()}"
    argv = [
        "--cluster.device",
        "cuda",
        "--cluster.ray_address",
        address,
        "--logging.run_dir",
        str(tmp_path),
    ]
    assert guarded(argv) == 2
    error = _error_line(capsys)  # the address is what fails, not the missing local GPUs
    assert f"cluster.ray_address='{address}': no Ray cluster" in error and "GPU" not in error


# --- 6. a Ray address where nothing answers ----------------------------------------------


def test_closed_ray_port_exits_2_in_seconds_naming_the_address(tmp_path, guarded, capsys):
    address = f"127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    assert guarded(["--cluster.ray_address", address, "--logging.run_dir", str(tmp_path)]) == 2
    error = _error_line(capsys)
    assert f"cluster.ray_address='{address}': no Ray cluster at {address}" in error
    assert time.monotonic() - started < 10 and not _ray_running()


def test_unroutable_address_gives_up_after_the_timeout(tmp_path, guarded, capsys):
    address = "192.0.2.1:6379"  # TEST-NET-1: never answers (or the network is unreachable)
    argv = [
        "--cluster.ray_address",
        address,
        "--cluster.connect_timeout_s",
        "1",
        "--logging.run_dir",
        str(tmp_path),
    ]
    started = time.monotonic()
    assert guarded(argv) == 2
    assert f"cluster.ray_address='{address}': no Ray cluster" in _error_line(capsys)
    assert time.monotonic() - started < 10


def test_ray_address_from_the_environment_is_named_so(tmp_path, guarded, monkeypatch, capsys):
    address = f"127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    assert guarded(["--logging.run_dir", str(tmp_path)]) == 2
    assert f"RAY_ADDRESS='{address}': no Ray cluster" in _error_line(capsys)


def test_reachable_addresses_pass_and_malformed_ones_are_named():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        check_reachable(f"127.0.0.1:{port}", 5.0)
        check_reachable(f"ray://127.0.0.1:{port}", 5.0)
    check_reachable("auto", 0.1)  # resolved by Ray on this machine
    with pytest.raises(ValueError, match=r"cluster\.ray_address='head' is not host:port"):
        check_reachable("head", 1.0, "cluster.ray_address")


# --- 4. malformed YAML and duplicate keys ------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        (
            "rollout:\n  group_size: 4\n  top_p: [0.9\nseed: 3\n",
            ":4:5",
            "expected ',' or ']', but got ':' (while parsing a flow sequence that began at "
            "line 3, column 10)",
        ),
        (
            "seed: 1\nrollout:\n\tgroup_size: 4\n",
            ":3:1",
            "found character '\\t' that cannot start any token",
        ),
        (
            "optimizer:\n  lr: 1.0e-4\n  eps: 1.0e-8\n  lr: 0.1\n",
            ":4:3",
            "duplicate key 'lr' (each option may be set once)",
        ),
        (
            "rollout:\n  group_size: 8\nseed: 1\nrollout:\n  top_p: 0.9\n",
            ":4:1",
            "duplicate key 'rollout'",
        ),
    ],
)
def test_bad_yaml_is_one_line_with_file_line_and_column(
    text, where, problem, tmp_path, guarded, capsys
):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert guarded(["--config", str(path), "--print-config"]) == 2
    error = _error_line(capsys)
    assert f"rl-train: error: config file {path}{where}: {problem}" in error


def test_duplicate_key_in_a_command_line_value(guarded, capsys):
    assert guarded(["--data.train", "[{path: a.jsonl, path: b.jsonl}]", "--print-config"]) == 2
    assert "data.train: duplicate key 'path'" in _error_line(capsys)


# --- 5. run directories made and write-tested before Ray starts --------------------------


def test_checkpoint_dir_that_is_a_file_exits_2(tmp_path, guarded, capsys):
    (tmp_path / "ckpt").write_text("not a directory")
    argv = ["--logging.run_dir", str(tmp_path / "run"), "--checkpoint.dir", str(tmp_path / "ckpt")]
    assert guarded(argv) == 2
    assert f"checkpoint.dir='{tmp_path / 'ckpt'}' is a file; give a directory" in _error_line(
        capsys
    )


def test_run_dir_under_a_file_exits_2(tmp_path, guarded, capsys):
    (tmp_path / "file").write_text("")
    assert guarded(["--logging.run_dir", str(tmp_path / "file" / "run")]) == 2
    error = _error_line(capsys)
    assert f"logging.run_dir='{tmp_path / 'file' / 'run'}' is not a writable directory" in error
    assert "Not a directory" in error and not _ray_running()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_unwritable_checkpoint_dir_exits_2(tmp_path, guarded, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    argv = ["--logging.run_dir", str(tmp_path / "run"), "--checkpoint.dir", str(locked / "c")]
    assert guarded(argv) == 2
    error = _error_line(capsys)
    assert "checkpoint.dir=" in error and "Permission denied" in error


def test_prepared_dirs_leave_nothing_behind_and_still_count_as_fresh(tmp_path):
    config, _ = load_config(["--logging.run_dir", str(tmp_path / "run")])
    dirs = prepare_run_dirs(config)
    assert dirs == {
        "logging.run_dir": tmp_path / "run",
        "checkpoint.dir": tmp_path / "run" / "checkpoints",
    }
    assert list((tmp_path / "run").iterdir()) == [tmp_path / "run" / "checkpoints"]
    assert not any((tmp_path / "run" / "checkpoints").iterdir())
    check_fresh(config, tmp_path / "run")  # an empty checkpoint directory holds no run
    (tmp_path / "run" / "checkpoints" / "step_000001").mkdir()
    with pytest.raises(ValueError, match="already holds a run"):
        check_fresh(config, tmp_path / "run")
