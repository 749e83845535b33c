"""The run's reward under its options: with ``rollout.reward_timeout_s`` a synchronous reward
runs in worker processes, so one that spins or sleeps for good costs its time limit and is
counted (or stops the run naming the option); a real rl-train run with such a reward
finishes; failures the reward skipped add to those rl-sglang's rollout counted."""

import asyncio
import time
from types import SimpleNamespace

import pytest
from test_train_loop import ROOT, shrunk

from rl_core.types import Sample, SampleStatus
from rl_launcher.cli import main
from rl_launcher.config.loader import load_config
from rl_launcher.infra.run_log import read_metrics
from rl_launcher.loops.extras import reward_counts
from rl_launcher.roles.default_rollout import rollout_settings
from rl_launcher.roles.reward import RewardError, load_reward
from rl_launcher.roles.rollout_manager import RolloutManager, take_rollout_counts
from rl_launcher.session.model import load_tokenizer

TOKENIZER = ROOT / "examples/quickstart/tokenizer"
STUCK = "stuck_rewards:stuck_reward"  # spins on label "spin", sleeps on "sleep"


def mapping_reward(response: str, label: str) -> dict:
    return {"acc": float(response == label), "nan": float("nan") if label == "nan" else 0.0}


async def async_reward(response: str, label: str) -> float:
    if label == "spin":
        await asyncio.sleep(60)
    return 1.0


def samples(labels: list[str], response: str = "7") -> list[Sample]:
    tokenizer = load_tokenizer(TOKENIZER)
    prompt = tokenizer.encode("3+4=", add_special_tokens=False)
    ids = tokenizer.encode(response, add_special_tokens=False)
    return [
        Sample(tokens=prompt + ids, response_length=len(ids), label=label, index=i)
        for i, label in enumerate(labels)
    ]


async def score(reward, batch: list[Sample]) -> list:
    return await asyncio.gather(*(reward.rollout_fn(s) for s in batch))


@pytest.mark.parametrize(
    ("extra", "on_error", "timeout"),
    [
        ([], "raise", 60.0),
        (["--rollout.on_reward_error", "skip", "--rollout.reward_timeout_s", "2.5"], "skip", 2.5),
        (["--rollout.reward_timeout_s", "null"], "raise", None),
    ],
)
def test_reward_options_reach_the_runs_reward_not_the_guard(tmp_path, extra, on_error, timeout):
    config, _ = load_config(shrunk(tmp_path / "run", *extra))
    manager = RolloutManager(
        config,
        model_dir=tmp_path,
        tokenizer=load_tokenizer(TOKENIZER),
        source=None,
        log_dir=tmp_path,
    )
    reward = manager.reward_fn
    try:
        settings = rollout_settings(config, 4, manager.sampling_params())
    finally:
        manager.stop()
    assert (reward.on_error, reward.timeout_s) == (on_error, timeout)
    assert (reward.pool is None) == (timeout is None)  # processes only under a time limit
    assert (reward.rollout_fn == reward.ascore) == (timeout is not None)
    # the reward applies both options itself: rl-sglang's guard raises what gets past it
    assert settings.reward_timeout_s is None and settings.reward_on_error == "raise"
    assert settings.num_groups == 4 and settings.n_samples_per_prompt == config.rollout.group_size
    if reward.pool is not None:  # stopped with the manager
        with pytest.raises(RuntimeError, match="closed"):
            reward.pool.submit("7", "7")


@pytest.mark.integration
def test_spinning_and_sleeping_rewards_cost_one_time_limit_and_are_counted():
    reward = load_reward(STUCK, load_tokenizer(TOKENIZER), on_error="skip", timeout_s=1.0)
    try:
        asyncio.run(score(reward, samples(["7"])))  # the worker processes have loaded it
        batch = samples(["spin", "sleep", "7", "7", "3", "7"])
        start = time.monotonic()
        values = asyncio.run(score(reward, batch))
        elapsed = time.monotonic() - start
    finally:
        reward.close()
    assert elapsed < 1.0 + 1.0, f"scoring a batch with two hung samples took {elapsed:.2f} s"
    assert values == [0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert [s.status is SampleStatus.ABORTED for s in batch] == [True, True] + [False] * 4
    assert "took longer than rollout.reward_timeout_s=1 s" in batch[0].metadata["reward_error"]
    assert reward.take_counts() == {"reward_errors": 0, "reward_timeouts": 2}
    assert reward.take_counts() == {"reward_errors": 0, "reward_timeouts": 0}  # per step


@pytest.mark.integration
def test_a_hung_reward_stops_the_run_naming_the_reward_and_the_option():
    reward = load_reward(STUCK, load_tokenizer(TOKENIZER), timeout_s=1.0)
    try:
        with pytest.raises(
            RewardError,
            match=r"stuck_rewards:stuck_reward' took longer than "
            r"rollout.reward_timeout_s=1 s on sample 0 \(response '7'",
        ):
            asyncio.run(score(reward, samples(["spin"])))
    finally:
        reward.close()


def test_a_coroutine_reward_stays_on_the_event_loop_under_the_time_limit():
    reward = load_reward(
        f"{__name__}:async_reward", load_tokenizer(TOKENIZER), on_error="skip", timeout_s=0.5
    )
    assert reward.pool is None
    start = time.monotonic()
    assert asyncio.run(score(reward, samples(["spin", "7"]))) == [0.0, 1.0]
    assert time.monotonic() - start < 5
    assert reward.take_counts() == {"reward_errors": 0, "reward_timeouts": 1}


def test_mapping_and_non_finite_rewards_name_the_option_that_governs_them():
    tokenizer = load_tokenizer(TOKENIZER)
    unkeyed = load_reward(f"{__name__}:mapping_reward", tokenizer, on_error="skip")
    with pytest.raises(
        ValueError,
        match=r"mapping with keys \['acc', 'nan'\]; set "
        "algorithm.reward_key",
    ):
        unkeyed(samples(["7"])[0])  # a setting to fix, not a sample to skip
    keyed = load_reward(f"{__name__}:mapping_reward", tokenizer, reward_key="acc")
    assert keyed(samples(["7"])[0]) == {"acc": 1.0, "nan": 0.0}
    with pytest.raises(RewardError, match=r"mapping_reward' returned \{'acc': 0.0, 'nan': nan\}"):
        keyed(samples(["nan"])[0])


def test_skipped_failures_add_to_those_the_rollout_counted():
    reward = load_reward("exact_match", load_tokenizer(TOKENIZER), on_error="skip")
    reward.counts = {"reward_errors": 3, "reward_timeouts": 1}  # skipped by the reward
    rollout = {"rollout/reward_errors": 2.0, "rollout/reward_timeouts": 0.0, "rollout/x": 1.0}
    take_rollout_counts(reward, rollout)  # what rl-sglang's guard counted: moved over
    assert rollout == {"rollout/x": 1.0}
    run = SimpleNamespace(rollout=SimpleNamespace(reward_fn=reward))
    step = reward_counts(run)
    assert step == {"rollout/reward_errors": 5.0, "rollout/reward_timeouts": 1.0}
    assert reward_counts(run) == {"rollout/reward_errors": 0.0, "rollout/reward_timeouts": 0.0}


@pytest.mark.integration
def test_rl_train_with_a_reward_that_hangs_on_some_samples_finishes_and_counts_them(tmp_path):
    """The user's case: a custom reward looping for good on some samples, a 1 s limit and
    on_reward_error=skip; two steps of the quickstart with real Ray, engine and trainer."""
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(
            f'{{"prompt": "{p}", "label": "{label}"}}\n'
            for p, label in [("1+1=", "2"), ("2+2=", "4"), ("3+4=", "spin"), ("0+0=", "0")]
        )
    )
    run_dir = tmp_path / "run"
    args = shrunk(
        run_dir,
        "--num_steps",
        "2",
        "--rollout.group_size",
        "2",
        "--data.train.0.path",
        str(data),
        "--checkpoint.interval",
        "0",
        "--rollout.reward",
        STUCK,
        "--rollout.reward_timeout_s",
        "1",
        "--rollout.on_reward_error",
        "skip",
    )
    start = time.monotonic()
    assert main(args) == 0
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2], f"took {time.monotonic() - start:.0f} s"
    for record in records:  # every step draws all 4 prompts: the "spin" group's 2 samples
        assert record["rollout/reward_timeouts"] == 2.0
        assert record["rollout/reward_errors"] == 0.0
        # both timed out: no scored sample left to compare with, the group is dropped
        assert record["rollout/groups_dropped_reward_error"] == 1.0
        assert record["buffer/groups_aborted"] == 0.0  # the engine aborted nothing


@pytest.mark.parametrize(
    ("extra", "kind", "grouped"),
    [
        ([], "sglang", True),
        (["--model.lora_rank", "8"], "embedded", True),  # n requests with adapters work there
        (["--model.lora_rank", "8"], "sglang", False),  # sglang#36894: unload after n > 1 hangs
        (["--model.lora_rank", "8", "--model.lora_sync", "merged"], "sglang", True),
    ],
)
def test_sglang_adapter_runs_send_one_request_per_sample(tmp_path, extra, kind, grouped):
    config, _ = load_config(shrunk(tmp_path / "run", *extra))
    config.engine.kind = kind  # set after loading: sglang is refused on this CPU machine
    assert rollout_settings(config, 4, {"max_new_tokens": 4}).group_requests is grouped
