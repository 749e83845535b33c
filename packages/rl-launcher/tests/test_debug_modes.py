"""Rollout-only runs (embedded engine + router, no trainer, no Ray), rollout dumps, and
bad input to ``rl-train``: each fails with exit status 2 and a message that names the
problem, or is skipped and counted when so configured."""

import json
from pathlib import Path

import pytest
import yaml

from rl_launcher.cli import main
from rl_launcher.infra.dumps import dump_files, read_rollout
from rl_launcher.infra.run_log import read_metrics

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "examples" / "quickstart"
ROWS = [
    {"prompt": "1+1=", "label": "2"},
    {"prompt": "2+2=", "label": "boom"},
    "{broken",
    {"prompt": "3+1=", "label": "4"},
    {"prompt": "0+0=", "label": "boom"},
]


def boom_reward(response: str, label) -> float:
    """Raises on the rows labelled "boom"; exact match otherwise."""
    if label == "boom":
        raise KeyError("no answer for this row")
    return float(response.strip() == label)


def boom_or_nan_reward(response: str, label) -> float:
    """NaN on the rows labelled "nan"; otherwise :func:`boom_reward`."""
    return float("nan") if label == "nan" else boom_reward(response, label)


def write_config(tmp_path: Path, rows=ROWS, reward="boom_reward", **sections) -> Path:
    data = tmp_path / "data.jsonl"
    data.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    tree = yaml.safe_load((QUICKSTART / "config.yaml").read_text())
    tree["model"]["tokenizer_path"] = str(QUICKSTART / "tokenizer")
    tree["data"]["train"] = [{"path": str(data)}]
    tree["rollout"].update(batch_size=4, group_size=2, reward=f"{__name__}:{reward}")
    tree["logging"] = {"run_dir": str(tmp_path / "run")}
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.integration
def test_rollout_only_dumps_and_counts_skipped_rewards_and_rows(tmp_path, capsys):
    config = write_config(
        tmp_path,
        rollout={
            "rollout_only": True,
            "on_reward_error": "skip",
            "dump_dir": str(tmp_path / "dumps"),
        },
    )
    assert main(["--config", str(config), "--num_steps", "2"]) == 0
    assert "step 2/2 | reward" in capsys.readouterr().out
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:  # 4 prompts a step, 2 of them "boom": 2 x 2 samples skipped
        assert record["rollout/reward_errors"] == 4.0
        assert record["rollout/num_samples"] == 8.0 and record["rollout/aborted_samples"] == 4.0
        assert "loss/pg" not in record
    assert records[0]["data/data/malformed"] == 1.0 and "data/data/malformed" not in records[1]
    dumps = dump_files(tmp_path / "dumps")
    assert len(dumps) == 2
    samples = [s for group in read_rollout(dumps[0]) for s in group]
    skipped = sorted((s.label, s.status.value) for s in samples if "reward_error" in s.metadata)
    assert skipped == [("boom", "aborted")] * 4  # kept in the dump, never trained on
    assert sorted(s.label for s in samples if s.status != "aborted") == ["2", "2", "4", "4"]


@pytest.mark.integration
def test_nan_rewards_are_counted_with_the_errors_in_the_metrics(tmp_path):
    rows = [
        {"prompt": "1+1=", "label": "2"},
        {"prompt": "2+2=", "label": "boom"},
        {"prompt": "3+1=", "label": "nan"},
        {"prompt": "0+0=", "label": "nan"},
    ]
    config = write_config(
        tmp_path,
        rows,
        "boom_or_nan_reward",
        rollout={"rollout_only": True, "on_reward_error": "skip"},
    )
    assert main(["--config", str(config), "--num_steps", "1"]) == 0
    [record] = read_metrics(tmp_path / "run")
    assert record["rollout/reward_errors"] == 6.0  # 2 samples raised, 4 returned NaN
    assert record["rollout/aborted_samples"] == 6.0 and record["rollout/reward_timeouts"] == 0.0


@pytest.mark.integration
def test_a_reward_that_raises_stops_the_run_with_exit_2(tmp_path, capsys):
    config = write_config(tmp_path, rollout={"rollout_only": True})
    assert main(["--config", str(config), "--num_steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "boom_reward' failed on sample" in err and "KeyError" in err
    assert "rollout.on_reward_error=skip" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rollout.batchsize", "4"], "rollout.batchsize"),
        (["--algorithm.advantage_estimator", "grpoo"], "grpoo"),
        (["--algorithm.policy_loss", "nope"], "algorithm.policy_loss"),
        (["--mode", "dpo"], "mode"),
        (["--data.train.0.path", "/nonexistent/data.jsonl"], "does not exist"),
        (["--data.on_malformed", "raise"], ":3: invalid JSON"),
        (["--rollout.reward", "no_such_reward"], "no_such_reward"),
        (["--rollout.replay_dir", "/nonexistent/dumps"], "holds no rollout_*.jsonl"),
        (["--mode", "sft", "--rollout.dump_dir", "dumps"], "mode=sft starts no engines"),
        (["--rollout.replay_dir", "d", "--rollout.rollout_only", "true"], "exclude each other"),
    ],
)
def test_bad_input_exits_2_with_a_message(tmp_path, capsys, args, message):
    config = write_config(tmp_path)
    assert main(["--config", str(config), *args]) == 2
    assert message in capsys.readouterr().err
