"""rollout.over_sampling: DAPO's refill in the synchronous rollout. The rollout manager and
rl-sglang's default rollout are real; the engine answers from a script (a group of a
"flat" prompt scores all ones, which the nonzero_std filter drops; a "slow" prompt's
first request waits until it is aborted) and the reward reads the response."""

import asyncio
from types import SimpleNamespace

import pytest
from test_train_loop import ROOT, shrunk

from rl_core.types import Sample
from rl_launcher.config.loader import load_config
from rl_launcher.data.buffer import DataBuffer
from rl_launcher.roles.rollout_manager import RolloutManager
from rl_launcher.session.model import load_tokenizer

TOKENIZER = ROOT / "examples/quickstart/tokenizer"
URL = "http://engine.invalid"


class ScriptedEngine:
    """/generate: row i answers "1" when i is odd, else "0"; every row "1" for "flat".
    The prompt's label is read from its first token (see :class:`Prompts`)."""

    def __init__(self, tokenizer, labels: list[str]):
        self.ids = {text: tokenizer.encode(text, add_special_tokens=False) for text in "01"}
        self.labels, self.aborted, self.slowed = labels, asyncio.Event(), set()

    async def generate(self, *, input_ids, sampling_params, return_logprob, rid):
        draw = input_ids[0]
        label = self.labels[draw]
        if label == "slow" and draw not in self.slowed:  # first time: until aborted
            self.slowed.add(draw)
            await self.aborted.wait()
            return [self._output([], "abort") for _ in range(sampling_params["n"])]
        await asyncio.sleep(0)
        texts = ["1" if label == "flat" or i % 2 else "0" for i in range(sampling_params["n"])]
        return [self._output(self.ids[text], "stop") for text in texts]

    @staticmethod
    def _output(ids: list[int], finish: str) -> dict:
        return {"output_ids": ids, "meta_info": {"finish_reason": {"type": finish}}}

    async def abort(self) -> None:
        self.aborted.set()

    async def close(self) -> None:
        """Nothing to close."""


class Prompts:
    """Draw k is the prompt [k] (its label is the engine's ``labels[k]``)."""

    def __init__(self):
        self.draws = 0

    def next_prompt(self) -> Sample:
        draw, self.draws = self.draws, self.draws + 1
        return Sample(
            tokens=[draw],
            response_length=0,
            label="1",
            group_index=draw,
            metadata={"dataset": "t", "row": draw},
        )

    def state_dict(self) -> dict:
        return {"draws": self.draws}


class Reward:
    """1.0 when the response is the label, else 0.0; the counts the manager moves in."""

    def __init__(self, tokenizer):
        self.tokenizer, self.counts = tokenizer, {}

    async def rollout_fn(self, sample: Sample) -> float:
        response = self.tokenizer.decode(sample.tokens[sample.prompt_length :]).strip()
        return float(response == sample.label)

    def count(self, name: str, number: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + number

    def close(self) -> None:
        """Nothing to close."""


def scripted_manager(tmp_path, labels: list[str], *extra: str):
    config, _ = load_config(
        shrunk(tmp_path / "run", "--algorithm.group_filter", "nonzero_std", *extra)
    )
    tokenizer = load_tokenizer(TOKENIZER)
    manager = RolloutManager(
        config, model_dir=tmp_path, tokenizer=tokenizer, source=Prompts(), log_dir=tmp_path
    )
    manager.reward_fn.close()
    manager.reward_fn = Reward(tokenizer)
    manager.engines.servers = [SimpleNamespace(url=URL, stop=lambda: None)]
    manager.engines._clients[URL] = ScriptedEngine(tokenizer, labels)
    return config, manager


def trained_draws(config, groups) -> list[int]:
    buffer = DataBuffer.from_config(config, num_ranks=1)
    buffer.add_groups(groups)
    return [s.group_index for s in buffer.pop_step(buffer.num_ready_groups).samples[::4]]


LABELS = ["flat", "flat", "slow", "mixed", "mixed", "mixed", "mixed", "mixed", "mixed", "mixed"]


def test_over_sampling_refills_the_batch_and_recycles_what_it_aborted(tmp_path):
    config, manager = scripted_manager(tmp_path, LABELS, "--rollout.over_sampling", "2")
    try:
        groups, metrics = manager.rollout(num_groups=4)
        # draws 0, 1 dropped (flat), 2 aborted when 3..6 had passed: 7 launched of 8 allowed
        assert trained_draws(config, groups) == [3, 4, 5, 6]
        assert metrics["rollout/groups_launched"] == 7
        assert metrics["rollout/groups_passed"] == 4
        assert metrics["rollout/groups_dropped"] == 2
        assert metrics["rollout/groups_aborted"] == 1
        manager.consumed(groups)
        # the dropped prompts are done with; the aborted one is pending for a checkpoint
        assert [p["group_index"] for p in manager.data_state()["pending"]] == [2]
        groups, metrics = manager.rollout(num_groups=4)
        # draw 2 resumes first, then new prompts; budget 8 - 1 resumed
        assert trained_draws(config, groups) == [2, 7, 8, 9]
        assert metrics["rollout/groups_aborted"] == 0
        manager.consumed(groups)
        assert manager.data_state()["pending"] == []
        assert manager.source.draws == 10  # only launched prompts are drawn
    finally:
        manager.stop()


def test_without_over_sampling_the_buffer_filters_and_the_step_is_short(tmp_path):
    labels = [label.replace("slow", "mixed") for label in LABELS]
    config, manager = scripted_manager(tmp_path, labels)
    try:
        groups, _ = manager.rollout(num_groups=4)
        assert trained_draws(config, groups) == [2, 3]  # 0 and 1 filtered, not replaced
        assert manager.source.draws == 4
    finally:
        manager.stop()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ([], "group_filter=keep_all"),
        (["--algorithm.group_filter", "nonzero_std", "--rollout.loop", "async"], "loop=async"),
        (
            [
                "--algorithm.group_filter",
                "nonzero_std",
                "--rollout.loop",
                "one_step_async",
                "--rollout.partial_rollout",
                "true",
            ],
            "partial_rollout",
        ),
    ],
)
def test_over_sampling_is_refused_where_nothing_refills(tmp_path, extra, named):
    with pytest.raises(ValueError, match=named):
        load_config(shrunk(tmp_path, "--rollout.over_sampling", "2", *extra))
