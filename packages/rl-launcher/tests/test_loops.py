"""The three loops end to end on CPU with real Ray, an embedded engine behind the real
sglang-router and an rl-fsdp training actor: the quickstart config shrunk to tiny
batches. One run is started for the module (Ray, actor, engine and router once) and its
steps go through each loop's feed in turn, three steps each, weight versions counting
on. Each loop must put the trainer's weights into the engines (versions advance; the
engine's log-probs equal the trainer's) and keep its bound on how stale trained samples
are; the async one also resumes a partial rollout across a weight update."""

import asyncio
import copy

import pytest
import torch
from test_train_loop import LOGPROB_TOL, engine_response, shrunk, trainer_log_probs

from rl_launcher.config.loader import load_config
from rl_launcher.data.buffer import DataBuffer
from rl_launcher.infra import data_order
from rl_launcher.loops.feeds import AsyncFeed, OneStepAsyncFeed, SyncFeed
from rl_launcher.loops.rl import run_step
from rl_launcher.session.start import start_run

pytestmark = pytest.mark.integration
STEPS = 3  # per loop


class Session:
    """The module's run and the number of the last step it trained."""

    def __init__(self, run):
        self.run, self.step = run, 0
        self.buffer = DataBuffer.from_config(run.config, num_ranks=run.num_ranks)

    def steps(self, feed) -> list[dict]:
        """STEPS steps through ``feed``, then the feed is closed."""
        first, self.step = self.step + 1, self.step + STEPS
        try:
            return [run_step(self.run, self.buffer, k, feed) for k in range(first, self.step + 1)]
        finally:
            feed.close()

    def check_engines_hold_the_trainers_weights(self) -> None:
        assert self.run.rollout.engines.weight_versions() == [str(self.step)]
        prompt_ids = self.run.source.datasets[0].prompts[0].tokens
        output = engine_response(self.run, prompt_ids)
        engine = torch.tensor([lp for lp, *_ in output["meta_info"]["output_token_logprobs"]])
        trainer = trainer_log_probs(self.run, prompt_ids, output)
        torch.testing.assert_close(engine, trainer, atol=LOGPROB_TOL, rtol=0)


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("loops") / "run"
    extra = (
        "--num_steps",
        str(3 * STEPS),
        "--rollout.max_staleness",
        "1",
        "--rollout.partial_rollout",
        "true",
        "--model.init_config.max_position_embeddings",
        "256",
        "--engine.max_context",
        "256",
    )  # room for the 200 forced tokens below
    config, _ = load_config(shrunk(run_dir, *extra))
    run = start_run(config)
    yield Session(run)
    run.close()


def versions_and_staleness(records) -> tuple[list, list]:
    return (
        [r["sync/weight_version"] for r in records],
        [r["rollout/staleness_max"] for r in records],
    )


def test_sync_loop_trains_on_the_trainers_own_weights(session):
    records = session.steps(SyncFeed(session.run))
    session.check_engines_hold_the_trainers_weights()
    assert versions_and_staleness(records) == ([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert [r["rollout/weight_version_min"] for r in records] == [0.0, 1.0, 2.0]
    assert all(r["mismatch/logprob_abs_diff_max"] < LOGPROB_TOL for r in records)
    # the prompts trained on, step by step, are the prompt stream in order
    order = data_order.read(session.run.config.logging.run_dir)
    assert [r["draws"] for r in order] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_one_step_async_loop_is_exactly_one_version_behind(session):
    first = session.step + 1  # 4: the engines hold version 3
    records = session.steps(OneStepAsyncFeed(session.run, last_step=first + STEPS - 1))
    session.check_engines_hold_the_trainers_weights()
    # step k+1's rollout ran during step k, on the weights of step k-1
    assert versions_and_staleness(records) == ([4.0, 5.0, 6.0], [0.0, 1.0, 1.0])
    assert [r["rollout/weight_version_min"] for r in records] == [3.0, 3.0, 4.0]
    assert records[0]["mismatch/logprob_abs_diff_max"] < LOGPROB_TOL  # on-policy step
    assert all("mismatch/logprob_abs_diff_max" not in r for r in records[1:])
    order = data_order.read(session.run.config.logging.run_dir)[-STEPS:]
    assert [r["draws"][0] for r in order] == [12, 16, 20]  # no prompt skipped or repeated


def test_async_loop_bounds_staleness_and_counts_what_it_drops(session):
    records = session.steps(AsyncFeed(session.run))
    session.check_engines_hold_the_trainers_weights()
    assert versions_and_staleness(records)[0] == [7.0, 8.0, 9.0]
    # rollout.max_staleness=1: older groups are dropped before training, and counted
    assert all(r["rollout/staleness_max"] <= 1 for r in records)
    assert all(r["async/stale_groups_kept"] == 0 for r in records)
    assert all(r["async/stale_groups_dropped"] >= 0 for r in records)
    fresh = [r for r in records if "mismatch/logprob_abs_diff_max" in r]
    assert all(r["mismatch/logprob_abs_diff_max"] < LOGPROB_TOL for r in fresh)


def test_partial_rollout_keeps_its_tokens_across_a_weight_update(session):
    """One group of 200 forced tokens, paused mid-way while the engine's weights change
    (version +1), then resumed by rl-sglang's default rollout from its leftovers."""
    manager, num_tokens, version = session.run.rollout, 200, str(session.step)
    manager.sampling_params = lambda: {"max_new_tokens": num_tokens, "ignore_eos": True}
    engines = manager.engines
    engine = engines.client(engines.urls[0])
    model_dir = f"{session.run.config.logging.run_dir}/initial_model"
    new_version = str(session.step + 1)

    async def cut_and_resume():
        task = asyncio.ensure_future(manager.generate(1, 1))
        while (await engine.server_info())["internal_states"][0]["num_running"] == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # some tokens, far from all of them
        await engines.pause_generation()
        first = await task
        cut = copy.deepcopy(first.leftovers[0][0])
        await engine.update_weights_from_disk(model_dir, weight_version=new_version)
        await engines.continue_generation()
        second = await manager.generate(1, 0, resume=first.leftovers)
        return cut, second.groups[0][0]

    cut, resumed = engines.call(cut_and_resume())
    assert 0 < cut.response_length < num_tokens and cut.weight_versions == [version]
    assert resumed.weight_versions == [version, new_version] and resumed.metadata["resumed"] == 1
    assert resumed.response_length == num_tokens == len(resumed.rollout_log_probs)
    assert resumed.tokens[: len(cut.tokens)] == cut.tokens
    assert resumed.rollout_log_probs[: cut.response_length] == cut.rollout_log_probs
