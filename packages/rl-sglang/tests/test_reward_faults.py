"""Reward functions that raise, hang or return NaN/inf inside a real rollout: scored as
configured (0 or the group dropped), counted, and the rollout completes; or, by default,
the rollout stops with the error."""

import asyncio
import functools
import time

import pytest

from conftest import run
from rl_core.types import Sample, scalar_reward
from rl_sglang.client import EngineClient
from rl_sglang.rollout.default import RolloutConfig, default_rollout
from rl_sglang.rollout.generate import GenerateContext
from rl_sglang.rollout.rewards import RewardFailed, RewardGuard, bad_reward, reward_name

pytestmark = pytest.mark.integration
FAULTS = ["raise", "nan", "inf", "hang", "async_hang"]


def faulty_reward(sample: Sample):
    """1.0 for "ok" prompts; each other label is one way a reward goes wrong."""
    kind = sample.label
    if kind == "raise":
        raise ZeroDivisionError("broken verifier")
    if kind == "nan":
        return float("nan")
    if kind == "inf":
        return {"acc": float("inf"), "note": "dict rewards are checked too"}
    if kind == "hang":
        time.sleep(30)  # a sync call the event loop could not interrupt
    if kind == "async_hang":
        return asyncio.sleep(30)
    return 1.0


def _prompts(labels):
    return [Sample(prompt="", tokens=[4 + i, 2], label=label) for i, label in enumerate(labels)]


def _rollout(cluster, labels, **config):
    config = RolloutConfig(
        n_samples_per_prompt=2,
        reward_timeout_s=1.0,
        sampling_params={"max_new_tokens": 3, "ignore_eos": True},
        **config,
    )

    async def go():
        async with EngineClient(cluster.router.url) as client:
            ctx = GenerateContext(client=client)
            return await default_rollout(ctx, iter(_prompts(labels)), faulty_reward, config)

    return run(go())


def test_zero_scores_each_failure_zero_counts_it_and_completes(cluster):
    labels = ["ok", *FAULTS, "ok"]
    started = time.monotonic()
    result = _rollout(cluster, labels, num_groups=len(labels), reward_on_error="zero")
    assert time.monotonic() - started < 20  # hung rewards cost their timeout, not 30 s
    by_label = {group[0].label: group for group in result.groups}
    assert sorted(by_label) == sorted(set(labels)) and len(result.groups) == len(labels)
    for label, group in by_label.items():
        assert [s.reward for s in group] == [1.0 if label == "ok" else 0.0] * 2
        assert all(("reward_error" in s.metadata) == (label != "ok") for s in group)
    assert result.metrics["rollout/reward_errors"] == 6  # raise, nan, inf: 2 samples each
    assert result.metrics["rollout/reward_timeouts"] == 4


def test_drop_leaves_failed_groups_out_and_refills_the_batch(cluster):
    # one group in flight at a time (num_groups 1, two samples per group, two slots): every
    # faulty group ends before the ok one starts, so none is still pending when the batch fills
    labels = [*FAULTS, "ok"]
    result = _rollout(cluster, labels, num_groups=1, max_concurrency=2, reward_on_error="drop")
    assert [g[0].label for g in result.groups] == ["ok"]
    assert all(s.reward == 1.0 for g in result.groups for s in g)
    assert result.metrics["rollout/groups_dropped_reward_error"] == len(FAULTS)
    assert result.metrics["rollout/reward_errors"] + result.metrics["rollout/reward_timeouts"] == 10


@pytest.mark.parametrize("label", ["raise", "nan"])
def test_raise_is_the_default_and_names_the_failure(cluster, label):
    expected = ZeroDivisionError if label == "raise" else RewardFailed
    with pytest.raises(
        expected, match="broken verifier" if label == "raise" else "non-finite"
    ) as info:
        _rollout(cluster, [label], num_groups=1)
    where = "reward 'faulty_reward' on sample 0"
    if label == "raise":  # the reward's own exception, with a note saying where
        assert info.value.__notes__ == [f"in {where}"]
    else:
        assert str(info.value).startswith(f"{where}: non-finite: reward returned nan")
        assert "reward_on_error='raise' stops the rollout" in str(info.value)


def test_failures_name_the_reward_function():
    class Named:
        name = "pkg.mod:fn"

        async def score(self, sample):
            return 1.0

    assert reward_name(Named().score) == "pkg.mod:fn"  # the launcher's rewards
    assert reward_name(faulty_reward) == "faulty_reward"
    assert reward_name(functools.partial(faulty_reward)) == "faulty_reward"


def test_a_mapping_reward_without_its_key_names_the_keys_and_the_option():
    sample = Sample(tokens=[1], reward={"acc": 1.0, "fmt": 0.5}, index=3)
    assert scalar_reward(sample, "acc") == 1.0
    for key in (None, "accuracy"):
        with pytest.raises(
            ValueError,
            match=r"sample 3 is a mapping with keys \['acc', 'fmt'\]; "
            r"set reward_key \(RolloutConfig.reward_key",
        ):
            scalar_reward(sample, key)


def test_bad_reward_values():
    assert bad_reward(1.0) is None and bad_reward(True) is None and bad_reward({"a": 1}) is None
    assert "non-finite" in bad_reward(float("-inf")) and "non-finite" in bad_reward({"a": 1e999})
    assert "not a number" in bad_reward(None) and "not a number" in bad_reward("1.0")
    with pytest.raises(ValueError, match="reward_on_error"):
        RewardGuard(faulty_reward, None, on_error="ignore")
    with pytest.raises(ValueError, match="reward_on_error"):
        RolloutConfig(num_groups=1, reward_on_error="ignore")


def test_reward_threads_are_reused_and_a_hung_call_gets_replaced():
    import threading

    from rl_sglang.rollout.rewards import DaemonThreads

    threads = DaemonThreads(name="reward-test")
    release = threading.Event()

    def fails():
        raise KeyError("no answer")

    async def go():
        sequential = [await threads.submit(lambda i=i: i * 2) for i in range(50)]
        busy_names = {t.ident for t in threading.enumerate() if t.name == "reward-test"}
        hung = threads.submit(release.wait)  # holds its thread until released
        after = await asyncio.wait_for(threads.submit(lambda: "served"), 5)
        started = {t.ident for t in threading.enumerate() if t.name == "reward-test"}
        assert len(started) == len(busy_names) + 1  # the hung call's thread was replaced
        with pytest.raises(KeyError, match="no answer"):
            await threads.submit(fails)
        release.set()
        assert await hung is True
        return sequential, busy_names, after

    sequential, busy_names, after = asyncio.run(go())
    assert sequential == [2 * i for i in range(50)] and after == "served"
    # fifty calls one after another: one thread, reused (a thread per call made fifty)
    assert len(busy_names) == 1
