"""RewardPool: long-lived reward processes; a call that hangs (busy loop, sleep) is cut off
at its deadline without holding up the other calls or the caller's event loop."""

import asyncio
import os
import sys
import threading
import time

import pytest

from rl_rewards.pool import MAX_CHUNK, RewardPool, chunk_size, default_workers
from rl_rewards.workers import Outcome

pytestmark = pytest.mark.integration


def pid(response: str, label: object) -> int:
    """The scoring process's id (to see processes kept or replaced)."""
    if response == "hang":
        while True:
            pass
    return os.getpid()


def napper(response: str, label: object) -> float:
    time.sleep(float(response))
    return 1.0


def echo(response: str, label: object) -> dict:
    """A mapping reward: values other than numbers come back as they are."""
    if response == "boom":
        raise KeyError("no such answer")
    return {"score": float(response == label), "label": label}


async def score_all(pool: RewardPool, responses: list, labelled: bool = False) -> tuple:
    """Every response (or (response, label) pair) scored concurrently, and the longest the
    event loop went unserved."""
    lag, done = 0.0, False

    async def ticker():
        nonlocal lag
        while not done:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            lag = max(lag, time.monotonic() - before - 0.01)

    tick = asyncio.ensure_future(ticker())
    calls = responses if labelled else [(r, None) for r in responses]
    outcomes = await asyncio.gather(*(pool.score(*call) for call in calls))
    done = True
    await tick
    return outcomes, lag


@pytest.mark.parametrize("order", ["failures_first", "failures_last"])
def test_a_spinning_and_a_sleeping_call_cost_one_timeout_and_the_rest_are_scored(order):
    bad = ["hang", "sleep"]  # a busy loop and a blocking system call, no return from either
    responses = bad + ["ok"] * 6 if order == "failures_first" else ["ok"] * 6 + bad
    with RewardPool("reward_helpers:faulty", timeout_s=1.0, workers=2) as pool:
        assert pool.submit("ok", None).result(timeout=60) == Outcome(1.0)  # processes loaded
        start = time.monotonic()
        outcomes, lag = asyncio.run(score_all(pool, responses))
        elapsed = time.monotonic() - start
    assert elapsed < 1.0 + 1.0, f"a batch with two hung calls took {elapsed:.2f} s"
    assert [o.status for o in outcomes] == ["timeout" if r in bad else "ok" for r in responses]
    assert [o.value for o in outcomes] == [None if r in bad else 1.0 for r in responses]
    assert all(o.reason == "exceeded 1 s" for o in outcomes if o.status == "timeout")
    assert lag < 0.5, f"the event loop went {lag:.2f} s unserved"


def test_processes_live_across_calls_and_a_hung_one_is_replaced():
    with RewardPool(f"{__name__}:pid", timeout_s=1.0, workers=2) as pool:
        first = {pool.submit("ok", None).result(timeout=60).value for _ in range(20)}
        assert pool.submit("hang", None).result(timeout=30).status == "timeout"
        later = {pool.submit("ok", None).result(timeout=60).value for _ in range(20)}
    assert 1 <= len(first) <= 2 and os.getpid() not in first
    assert len(later) <= 2 and len(later - first) <= 1  # one process killed, one new


def test_waiting_in_the_queue_does_not_count_against_the_timeout():
    # One process, three calls of 0.6 s each with a 1 s limit: 1.8 s in all, none too long.
    with RewardPool(f"{__name__}:napper", timeout_s=1.0, workers=1) as pool:
        futures = [pool.submit("0.6", None) for _ in range(3)]
        assert [f.result(timeout=60) for f in futures] == [Outcome(1.0)] * 3


def test_values_and_errors_come_back_as_they_are():
    with RewardPool(f"{__name__}:echo", timeout_s=5.0, workers=2) as pool:
        good, bad = pool.submit("7", "7").result(60), pool.submit("boom", "7").result(60)
    assert good == Outcome({"score": 1.0, "label": "7"})
    assert bad == Outcome(None, "error", "KeyError: 'no such answer'")


def test_rewards_load_from_the_parents_sys_path(tmp_path, monkeypatch):
    with RewardPool("reward_helpers:boom", timeout_s=5.0, workers=1) as pool:
        pool.submit("x", None).result(timeout=60)  # the fork server runs: its sys.path is set
    (tmp_path / "late_reward_module.py").write_text("def fn(r, label):\n    return 0.25\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with RewardPool("late_reward_module:fn", timeout_s=5.0, workers=1) as pool:
        assert pool.submit("x", None).result(timeout=60) == Outcome(0.25)
    sys.modules.pop("late_reward_module", None)


def test_closing_stops_every_process_and_fails_unfinished_calls():
    pool = RewardPool(f"{__name__}:pid", timeout_s=30.0, workers=2)
    pids = {pool.submit("ok", None).result(timeout=60).value for _ in range(20)}
    hung = pool.submit("hang", None)
    queued = [pool.submit("ok", None) for _ in range(3)]
    time.sleep(0.5)
    pool.close()
    assert not pool._broker.is_alive()
    for pid_ in pids:  # the reward processes too, the hung one included
        with pytest.raises(ProcessLookupError):
            os.kill(pid_, 0)
    with pytest.raises(RuntimeError, match="closed"):
        hung.result(timeout=1)
    assert all(f.done() for f in queued)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("ok", None)


def test_a_long_queue_goes_out_in_chunks_and_a_hung_call_holds_up_only_its_own():
    # 400 calls on 2 processes go out 25 at a time; the hung first call's chunk waits for
    # its timeout, then the 24 calls behind it are scored elsewhere: about one timeout in all
    responses = ["hang"] + [str(i) for i in range(399)]
    with RewardPool(f"{__name__}:pid", timeout_s=1.0, workers=2) as pool:
        pool.submit("ok", None).result(timeout=60)
        start = time.monotonic()
        outcomes, lag = asyncio.run(score_all(pool, responses))
        elapsed = time.monotonic() - start
    assert chunk_size(len(responses), 2) == 25
    assert elapsed < 1.0 + 1.0, f"400 calls with one hung call took {elapsed:.2f} s"
    assert [o.status for o in outcomes] == ["timeout"] + ["ok"] * 399
    assert len({o.value for o in outcomes[1:]}) <= 3  # the two processes and a replacement
    assert lag < 0.5, f"the event loop went {lag:.2f} s unserved"


def test_chunks_grow_with_the_queue_up_to_a_bound():
    assert [chunk_size(n, 2) for n in (1, 15, 16, 33, 400, 10_000)] == [1, 1, 1, 2, 25, MAX_CHUNK]
    assert chunk_size(8, 1) == 1 and chunk_size(64, 8) == 1


def test_event_loops_in_several_threads_each_get_their_own_outcomes():
    # each loop's calls of one pass go to the broker together and settle on that loop
    with RewardPool(f"{__name__}:echo", timeout_s=5.0, workers=2) as pool:
        got: dict[int, list[Outcome]] = {}

        def one_loop(number: int) -> None:
            calls = [(str(i % 3), str(number % 3)) for i in range(50)]
            got[number] = asyncio.run(score_all(pool, calls, labelled=True))[0]

        threads = [threading.Thread(target=one_loop, args=(n,)) for n in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    for number in range(3):
        expected = [float(i % 3 == number % 3) for i in range(50)]
        assert [o.value["score"] for o in got[number]] == expected
        assert {o.value["label"] for o in got[number]} == {str(number % 3)}


def test_a_cancelled_wait_leaves_the_other_calls_and_a_closed_pool_fails_awaiting_ones():
    async def cancel_one(pool: RewardPool) -> list:
        slow = asyncio.ensure_future(pool.score("0.5", None))
        quick = [asyncio.ensure_future(pool.score("0.01", None)) for _ in range(4)]
        await asyncio.sleep(0.05)
        slow.cancel()
        return await asyncio.gather(slow, *quick, return_exceptions=True)

    async def closed_meanwhile(pool: RewardPool) -> list:
        waiting = [asyncio.ensure_future(pool.score("30", None)) for _ in range(2)]
        await asyncio.sleep(0.3)
        await asyncio.to_thread(pool.close)
        return await asyncio.gather(*waiting, return_exceptions=True)

    with RewardPool(f"{__name__}:napper", timeout_s=60.0, workers=2) as pool:
        slow, *quick = asyncio.run(cancel_one(pool))
        assert isinstance(slow, asyncio.CancelledError) and quick == [Outcome(1.0)] * 4
        closed = asyncio.run(closed_meanwhile(pool))
    assert all(isinstance(e, RuntimeError) and "closed" in str(e) for e in closed), closed
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(pool.score("0", None))


def test_bad_settings_and_unknown_rewards_fail_before_any_process_starts():
    with pytest.raises(ValueError, match="valid names"):
        RewardPool("no_such_reward", timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s > 0"):
        RewardPool("math", timeout_s=0)
    assert 2 <= default_workers() <= 8
