"""rl-train with ``rollout.source: buffer``: this test is the agent worker. It generates
with the run's engines through the router, posts scored groups to the run's rollout
buffer, and checks that the steps train on exactly those tokens with the weights moving
on; that a resumed run trains first on what the buffer still holds (a group served after
the last checkpoint included); and that a step short of groups stops the run clearly."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = AutoTokenizer.from_pretrained(ROOT / "examples/quickstart/tokenizer")


@pytest.fixture
def started():
    """Every rl-train a test starts, stopped at its end whatever happened."""
    processes = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=60)


def start_train(started: list, tmp_path: Path, *extra: str) -> subprocess.Popen:
    args = [
        "--config",
        str(ROOT / "examples/quickstart/config.yaml"),
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
        "--rollout.source",
        "buffer",
        "--rollout.buffer_timeout_s",
        "120",
        "--checkpoint.interval",
        "2",
        "--logging.progress",
        "false",
        *extra,
    ]
    started.append(
        subprocess.Popen(
            [sys.executable, "-m", "rl_launcher.cli", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    )
    return started[-1]


def wait_for(condition, what: str, process: subprocess.Popen, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := condition()) is not None:
            return value
        assert process.poll() is None, f"rl-train exited before {what}: {process.stdout.read()}"
        time.sleep(0.5)
    raise AssertionError(f"no {what} after {timeout_s} s")


def endpoints(run_dir: Path, process) -> dict:
    path = run_dir / "rollout_buffer_url.json"
    return wait_for(
        lambda: json.loads(path.read_text()) if path.exists() else None, "buffer URL", process
    )


def worker_group(engines: str, a: int, b: int) -> dict:
    """Two samples of "a+b=" from the run's engines, rewarded for the right digit."""
    prompt = TOKENIZER.encode(f"{a}+{b}=", add_special_tokens=False)
    samples = []
    for seed in (0, 1):
        out = requests.post(
            engines + "/generate",
            json={
                "input_ids": prompt,
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "sampling_seed": seed},
            },
            timeout=60,
        ).json()
        meta = out["meta_info"]
        samples.append(
            {
                "tokens": prompt + out["output_ids"],
                "prompt_length": len(prompt),
                "reward": float(TOKENIZER.decode(out["output_ids"]) == str(a + b)),
                "rollout_log_probs": [e[0] for e in meta["output_token_logprobs"]],
                "weight_versions": [str(meta["weight_version"])],
            }
        )
    return {"group": f"{a}+{b}", "samples": samples}


def post(buffer: str, group) -> requests.Response:
    return requests.post(buffer + "/buffer/write", json=group, timeout=30)


def dumped(tmp_path: Path) -> dict[int, list[dict]]:
    files = sorted((tmp_path / "dumps").iterdir())
    return {
        int(p.stem.split("_")[1]): [json.loads(x) for x in p.read_text().splitlines()]
        for p in files
    }


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.integration
def test_rl_train_trains_on_what_agent_workers_write_and_resumes_from_the_buffer(tmp_path, started):
    run_dir = tmp_path / "run"
    first = start_train(started, tmp_path)
    urls = endpoints(run_dir, first)
    bad = post(
        urls["buffer"],
        {"group": "x", "samples": [{"tokens": [1], "prompt_length": 1, "reward": 0}]},
    )
    assert bad.status_code == 400 and "prompt_length" in bad.json()["error"]
    posted = {}
    for a, b in ((1, 2), (2, 2)):  # step 1, on the starting weights (version 0)
        posted[f"{a}+{b}"] = worker_group(urls["engines"], a, b)
        assert post(urls["buffer"], posted[f"{a}+{b}"]).json()["accepted"] == 2
    assert post(urls["buffer"], posted["1+2"]).json()["accepted"] == 0  # a duplicate
    wait_for(lambda: True if records(run_dir) else None, "step 1", first)  # and its sync
    for a, b in ((3, 1), (0, 4), (4, 4)):  # steps 2 and (after a restart) 3
        posted[f"{a}+{b}"] = worker_group(urls["engines"], a, b)
        assert post(urls["buffer"], posted[f"{a}+{b}"]).status_code == 200
    output, _ = first.communicate(timeout=300)
    assert first.returncode == 0, output[-3000:]

    steps = dumped(tmp_path)
    for step, names in ((1, ["1+2", "2+2"]), (2, ["3+1", "0+4"])):
        trained = [
            (s["metadata"]["buffer_group"], s["tokens"], s["rollout_log_probs"])
            for s in steps[step]
        ]
        assert trained == [
            (n, s["tokens"], s["rollout_log_probs"]) for n in names for s in posted[n]["samples"]
        ]
        assert {v for s in steps[step] for v in s["weight_versions"]} == {str(step - 1)}
    first_records = records(run_dir)
    assert [r["sync/weight_version"] for r in first_records] == [1.0, 2.0]
    assert first_records[1]["rollout_buffer/rejected"] == 1
    assert first_records[1]["rollout_buffer/duplicates"] == 1
    held = json.loads((run_dir / "rollout_buffer.json").read_text())
    assert list(held["pending"]) == ["4+4"]  # served ones wait for the next collection
    assert [entry[1] for entry in held["served"]] == ["1+2", "2+2", "3+1", "0+4"]

    # step 3 takes 4+4 (half a batch is enough), is not checkpointed (interval 2), and
    # step 4 finds nothing: the run stops, saying so
    second = start_train(
        started,
        tmp_path,
        "--resume",
        "--num_steps",
        "4",
        "--rollout.buffer_min_ratio",
        "0.5",
        "--rollout.buffer_timeout_s",
        "3",
    )
    output, _ = second.communicate(timeout=300)
    assert second.returncode == 1, output[-3000:]
    assert "fewer than min_ratio=0.5 of 2" in output and "accepted 0, rejected 0" in output
    assert [s["metadata"]["buffer_group"] for s in dumped(tmp_path)[3]] == ["4+4", "4+4"]
    held = json.loads((run_dir / "rollout_buffer.json").read_text())
    assert held["pending"] == {} and [e[1] for e in held["served"]] == ["4+4"]

    # resumed from step 2 again: 4+4, served but never checkpointed, is trained again
    third = start_train(
        started,
        tmp_path,
        "--resume",
        "--num_steps",
        "3",
        "--rollout.buffer_min_ratio",
        "0.5",
        "--rollout.buffer_timeout_s",
        "3",
    )
    output, _ = third.communicate(timeout=300)
    assert third.returncode == 0, output[-3000:]
    [step3] = records(run_dir)[2:]
    assert step3["rollout_buffer/requeued"] == 1 and step3["sync/weight_version"] == 3.0
    again = dumped(tmp_path)[3]
    assert [s["tokens"] for s in again] == [s["tokens"] for s in posted["4+4"]["samples"]]
    assert json.loads((run_dir / "rollout_buffer.json").read_text())["pending"] == {}
