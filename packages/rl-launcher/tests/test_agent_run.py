"""Two rl-train steps of examples/agent through the agent gateway, driven by the real
``openai`` client: the trained samples are the engine's ids, masked to the model's turns,
and the second step's replies come from the weights the first step trained."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]


def random_init_config(tmp_path: Path) -> str:
    """examples/agent/config.yaml on the random-initialised model of sft.yaml (the example
    starts from the SFT warm-up's export, which these tests need not train first)."""
    config = yaml.safe_load((ROOT / "examples/agent/config.yaml").read_text())
    config["model"] = yaml.safe_load((ROOT / "examples/agent/sft.yaml").read_text())["model"]
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.integration
def test_two_agent_steps_train_on_the_engines_ids(tmp_path):
    log = tmp_path / "replies.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "examples" / "agent"),
        "RL_SGLANG_AGENT": "calculator_agent:solve",
        "AGENT_LOG": str(log),
    }
    args = [
        "--config",
        random_init_config(tmp_path),
        "--num_steps",
        "2",
        "--logging.run_dir",
        str(tmp_path / "run"),
        "--rollout.dump_dir",
        str(tmp_path / "dumps"),
        "--rollout.batch_size",
        "2",
        "--rollout.group_size",
        "2",
        "--rollout.max_response_tokens",
        "48",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "rl_launcher.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    replies = {}
    for line in log.read_text().splitlines():
        record = json.loads(line)
        replies.setdefault(record["session"], []).append(record)
    steps = [
        [json.loads(row) for row in (tmp_path / "dumps" / name).read_text().splitlines()]
        for name in sorted(os.listdir(tmp_path / "dumps"))
    ]
    assert len(steps) == 2 and all(len(step) >= 4 for step in steps)
    for step in steps:
        for sample in step:
            response = sample["tokens"][-sample["response_length"] :]
            trained = [t for t, m in zip(response, sample["loss_mask"], strict=True) if m]
            session = replies[sample["metadata"]["rid"]]
            assert trained == [t for r in session for t in r["token_ids"]]  # the engine's ids
            assert sample["loss_mask"][0] == 1  # the first reply starts the response
    versions = [{v for s in step for v in s["weight_versions"]} for step in steps]
    assert len(versions[0]) == len(versions[1]) == 1
    assert int(next(iter(versions[1]))) > int(next(iter(versions[0])))  # weights reached it


@pytest.mark.integration
def test_forked_episodes_train_as_groups_of_their_leaves(tmp_path):
    """tests/forking_agent.py forks every even episode: each group of two episodes is three
    samples, and the step trains all of them as one group."""
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parent),
        "RL_SGLANG_AGENT": "forking_agent:solve",
    }
    run_dir, dumps = tmp_path / "run", tmp_path / "dumps"
    args = [
        "--config",
        random_init_config(tmp_path),
        "--num_steps",
        "1",
        "--logging.run_dir",
        str(run_dir),
        "--rollout.dump_dir",
        str(dumps),
        "--rollout.batch_size",
        "2",
        "--rollout.group_size",
        "2",
        "--rollout.max_response_tokens",
        "4",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "rl_launcher.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    [metrics] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics["rollout/num_samples"] == metrics["train/num_samples"] == 6
    [name] = os.listdir(dumps)
    samples = [json.loads(row) for row in (dumps / name).read_text().splitlines()]
    sizes = {}
    for sample in samples:
        sizes.setdefault(sample["group_index"], []).append(sample["metadata"]["rid"])
    assert sorted(len(rids) for rids in sizes.values()) == [3, 3]
    leaves = sorted(rids.count(rid) for rids in sizes.values() for rid in set(rids))
    assert leaves == [1, 1, 2, 2]  # two episodes forked in two, two did not
