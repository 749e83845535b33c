"""One rl-train run of examples/extend/pool.yaml (a rollout function: a pool of groups that
aborts the stragglers) scored by rl-rewards' remote reward against a real HTTP scoring
server started here, configured through rollout.reward_options (url, token, timeout_s).
The pool is wrapped by a function that records ``ctx.step``; the run goes two steps, then
``--resume``s for two more with ``rollout.loop=one_step_async``."""

import json
import urllib.error
from pathlib import Path

import pytest
from aiohttp import web
from recording_rollout import STEPS_FILE
from recording_server import RecordingServer
from test_train_loop import ROOT

from rl_core.types import Sample
from rl_launcher.cli import main
from rl_launcher.infra.run_log import read_metrics
from rl_rewards import get_reward

pytestmark = pytest.mark.integration
TOKEN = "s3cret"
WRONG = 0.25  # what the server pays a wrong answer: no built-in reward gives it


async def score_with_token(body: dict, request) -> tuple[dict, dict]:
    """POST {response, label} with the bearer token -> {"score": 1 or WRONG}; else 401."""
    if request.headers.get("Authorization") != f"Bearer {TOKEN}":
        raise web.HTTPUnauthorized()
    score = 1.0 if body["response"].strip() == body["label"] else WRONG
    return body, {"score": score}


@pytest.fixture(scope="module")
def server():
    with RecordingServer("/score", score_with_token) as scoring:
        yield scoring


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, ray_cluster, server):
    run_dir = tmp_path_factory.mktemp("remote") / "run"
    options = json.dumps({"url": f"{server.url}/score", "token": TOKEN, "timeout_s": 10})
    mp = pytest.MonkeyPatch()
    mp.chdir(ROOT)  # the config's relative tokenizer and data paths
    try:
        args = [
            "--config",
            str(ROOT / "examples/extend/pool.yaml"),
            "--num_steps=2",
            f"--logging.run_dir={run_dir}",
            f"--rollout.dump_dir={run_dir / 'dumps'}",
            "--rollout.reward=remote",
            f"--rollout.reward_options={options}",
            "--rollout.rollout_function=recording_rollout:record_steps",
        ]
        assert main(args) == 0
        resumed = ["--resume", "--num_steps=4", "--rollout.loop=one_step_async"]
        assert main([*args[:2], *args[3:], *resumed]) == 0
    finally:
        mp.undo()
    return run_dir


def dumped(run_dir: Path, step: int) -> list[Sample]:
    path = run_dir / "dumps" / f"rollout_{step:06d}.jsonl"
    return [Sample.from_json(line) for line in path.read_text().splitlines()]


def test_the_remote_server_scored_every_trained_sample_with_the_token(run_dir, server):
    trained = [s for step in (1, 2, 3, 4) for s in dumped(run_dir, step)]
    assert len(trained) == 4 * 8 * 8  # four steps of batch_size groups of group_size
    for sample in trained:
        correct = sample.response.strip() == sample.label
        assert sample.reward == (1.0 if correct else WRONG)
    # every trained sample was asked about (stragglers the pool aborted may add requests)
    assert len(server.seen) >= len(trained)


def test_the_rollout_function_made_each_step(run_dir):
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        groups = {s.group_index for s in dumped(run_dir, record["step"])}
        assert len(groups) == 8
        # the pool drew up to two spare prompts and dropped what it did not return
        assert 0 <= record["rollout/prompts_dropped"] <= 2
        assert record["rollout/reward/min"] >= WRONG


def test_the_context_carries_the_step_across_a_resume(run_dir):
    """ctx.step is the step the rollout was started for: after --resume at step 2 the next
    rollout is step 3's (not a count restarted at 1), and in one_step_async step 4's rollout,
    launched while step 3 trains, says 4."""
    lines = (run_dir / STEPS_FILE).read_text().splitlines()
    seen = [(r["step"], r["loop"]) for r in map(json.loads, lines)]
    assert seen == [(1, "sync"), (2, "sync"), (3, "one_step_async"), (4, "one_step_async")]


def test_a_wrong_token_is_refused_by_the_server_not_retried(server):
    reward = get_reward(
        "remote", url=f"{server.url}/score", token="wrong", retries=3, backoff_s=5.0
    )
    with pytest.raises(urllib.error.HTTPError, match="401"):
        reward("7", "7")  # a 4xx fails at once: retried, it would take 35 s
