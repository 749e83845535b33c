"""User code by dotted path, without Ray: every option's function is imported (from the
config's directory too) and signature-checked at load, refused naming the option and the
signature expected; reward options, rewards of the whole Sample (in this process and in
reward worker processes), group rewards, the prompt source wrapper and the step hooks."""

import asyncio
import json
import textwrap
from types import SimpleNamespace

import pytest
from test_train_loop import ROOT

from rl_core.types import Sample, SampleStatus
from rl_launcher.config import DatasetConfig
from rl_launcher.config.loader import load_config
from rl_launcher.data.prompts import sample_from_row
from rl_launcher.data.source import CustomSource, build_prompt_source
from rl_launcher.roles.reward import GroupReward, RewardError, load_reward
from rl_launcher.roles.step_hooks import apply_step_hooks
from rl_launcher.session.model import load_tokenizer

TOKENIZER = load_tokenizer(ROOT / "examples/quickstart/tokenizer")
USER_CODE = """
import asyncio

def scored(sample, *, bonus=0.0):
    return float(sample.response == sample.label) + bonus + sample.metadata.get("extra", 0)

def two_args(response, label):
    return 1.0

def group_ranks(samples):
    return [float(i) for i in range(len(samples))]

def wrong_count(samples):
    return [1.0]

async def slow_group(samples):
    await asyncio.sleep(30)

def keep_long(sample):
    return len(sample.response) > 1

async def my_rollout(ctx):
    return []

def regroup(groups):
    return [g[:1] for g in groups[1:]]

def log(step, groups):
    return {"user/groups": len(groups), "user/step": step}

def bad_log(step, groups):
    return {"user/text": "x"}

def no_args():
    return None

class Counter:
    def __init__(self, data, *, seed, tokenizer):
        self.n = seed
    def next_prompt(self):
        from rl_core.types import Sample
        self.n += 1
        return Sample(prompt=str(self.n), tokens=[self.n], label=str(self.n))
    def state_dict(self):
        return {"n": self.n}
    def load_state_dict(self, state):
        self.n = state["n"]

class NoState:
    def __init__(self, data, *, seed, tokenizer):
        pass
    def next_prompt(self):
        pass
"""


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """A config file with a user module next to it (imported by that path only)."""
    directory = tmp_path_factory.mktemp("user_config")
    (directory / "ext_user_code.py").write_text(textwrap.dedent(USER_CODE))
    (directory / "run.yaml").write_text("num_steps: 1\n")
    return directory


def load(config_dir, *overrides):
    config, _ = load_config(["--config", str(config_dir / "run.yaml"), *overrides])
    return config


def test_paths_next_to_the_config_are_imported_and_accepted(config_dir):
    config = load(
        config_dir,
        "--rollout.reward=ext_user_code:scored",
        "--rollout.reward_options={bonus: 0.5}",
        "--rollout.group_reward=ext_user_code:group_ranks",
        "--rollout.sample_filter=ext_user_code:keep_long",
        "--rollout.post_process=ext_user_code:regroup",
        "--logging.rollout_log_function=ext_user_code:log",
        "--data.source=ext_user_code:Counter",
    )
    assert config.rollout.reward_options == {"bonus": 0.5}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--rollout.reward=remote", "--rollout.reward_options={url: http://x, tokn: a}"],
            r"rollout.reward_options: reward 'remote' takes no option tokn; its options: url, "
            r"token, timeout_s",
        ),
        (["--rollout.reward=remote"], r"rollout.reward_options: reward 'remote' needs url"),
        (
            ["--rollout.reward=exact_match", "--rollout.reward_options={bonus: 1}"],
            r"reward 'exact_match' takes no option bonus",
        ),
        (
            ["--rollout.reward=ext_user_code:scored", "--rollout.reward_options={bonsu: 1}"],
            r"takes no option bonsu; its options: bonus",
        ),
        (["--rollout.reward=ext_user_code:no_args"], r"rollout.reward .*cannot be called so"),
        (
            ["--rollout.group_reward=ext_user_code:no_args"],
            r"rollout.group_reward 'ext_user_code:no_args'.*expected \[async\] fn\(samples",
        ),
        (["--rollout.sample_filter=ext_user_code:two_args"], r"expected fn\(sample: Sample\)"),
        (["--rollout.post_process=ext_user_code:missing"], r"has no 'missing'"),
        (["--rollout.function=no_such_module_x:gen"], r"cannot import 'no_such_module_x'"),
        (["--rollout.rollout_function=ext_user_code:no_args"], r"RolloutContext"),
        (["--logging.rollout_log_function=ext_user_code:keep_long"], r"fn\(step: int, groups"),
        (["--data.source=ext_user_code:NoState"], r"data.source .* has no state_dict"),
        (["--rollout.sample_filter=keep_long"], r"not a dotted path"),
        (
            ["--algorithm.policy_loss=ext_user_code:two_args"],
            r"algorithm.policy_loss: policy loss .* expected fn\(log_probs, old_log_probs",
        ),
        (["--algorithm.loss_agg_mode=ext_user_code:no_args"], r"algorithm.loss_agg_mode: "),
        (["--algorithm.group_filter=ext_user_code:no_args"], r"algorithm.group_filter: "),
        (
            ["--algorithm.advantage_estimator=ext_user_code:two_args"],
            r"expected fn\(inputs: rl_core.advantages.AdvantageInputs\)",
        ),
        (
            ["--rollout.rollout_function=ext_user_code:my_rollout", "--rollout.loop=async"],
            r"rollout.rollout_function replaces the rollout of loop sync or one_step_async",
        ),
        (
            ["--rollout.group_reward=ext_user_code:group_ranks", "--eval.datasets=[{path: x}]"],
            r"rollout.group_reward scores training groups",
        ),
    ],
)
def test_bad_user_code_is_refused_at_load(config_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        load(config_dir, *overrides)


def test_a_data_row_keeps_its_other_columns_in_the_metadata():
    row = {"prompt": "3+4=", "label": "7", "a": 3, "source": "gen", "metadata": {"source": "m"}}
    sample = sample_from_row(row, DatasetConfig(path="x.jsonl"), apply_chat_template=False)
    assert sample.metadata == {"a": 3, "source": "m"}  # the metadata column wins a clash


def samples(responses: list[str], label: str = "7", extra: float = 0.0) -> list[Sample]:
    prompt = TOKENIZER.encode("3+4=", add_special_tokens=False)
    out = []
    for i, text in enumerate(responses):
        ids = TOKENIZER.encode(text, add_special_tokens=False)
        sample = Sample(tokens=prompt + ids, response_length=len(ids), label=label, index=i)
        sample.response, sample.metadata["extra"] = text, extra
        out.append(sample)
    return out


@pytest.mark.parametrize("timeout_s", [None, 20.0])  # in this process; in worker processes
def test_a_sample_reward_gets_the_whole_sample_and_its_options(config_dir, timeout_s):
    load(config_dir)  # puts the config's directory on sys.path
    reward = load_reward(
        "ext_user_code:scored", TOKENIZER, timeout_s=timeout_s, options={"bonus": 0.25}
    )
    try:
        batch = samples(["7", "8"], extra=1.0)
        values = asyncio.run(_score_all(reward, batch))
    finally:
        reward.close()
    assert (reward.pool is None) == (timeout_s is None)
    assert values == [2.25, 1.25]  # right + bonus + metadata["extra"]; wrong + the same


async def _score_all(reward, batch):
    results = [reward.rollout_fn(s) for s in batch]
    return [await r if asyncio.iscoroutine(r) else r for r in results]


def group_reward(path: str, **settings) -> GroupReward:
    return GroupReward(path, TOKENIZER, **({"on_error": "skip", "timeout_s": 5.0} | settings))


def test_a_group_reward_scores_the_group_as_it_finished(config_dir):
    load(config_dir)
    group = samples(["7", "8", "9"])
    group[1].status = SampleStatus.ABORTED  # aborted by the engine: not scored
    asyncio.run(group_reward("ext_user_code:group_ranks").rollout_fn.score(group))
    assert [s.reward for s in group] == [0.0, None, 1.0]


@pytest.mark.parametrize(
    ("path", "timeout_s", "problem"),
    [
        ("ext_user_code:wrong_count", 5.0, "not one number per sample"),
        ("ext_user_code:slow_group", 0.5, "took longer than rollout.reward_timeout_s=0.5"),
    ],
)
def test_a_failing_group_reward_is_skipped_or_raised(config_dir, path, timeout_s, problem):
    load(config_dir)
    group = samples(["7", "8"])
    reward = group_reward(path, timeout_s=timeout_s)
    asyncio.run(reward.rollout_fn.score(group))
    assert all(
        s.status is SampleStatus.ABORTED and problem in s.metadata["reward_error"] for s in group
    )
    assert sum(reward.take_counts().values()) == 2
    with pytest.raises(RewardError, match=problem):
        asyncio.run(
            group_reward(path, timeout_s=timeout_s, on_error="raise").rollout_fn.score(
                samples(["7", "8"])
            )
        )


def test_a_custom_source_numbers_draws_and_restores_its_position(config_dir):
    config = load(config_dir, "--data.source=ext_user_code:Counter", "--seed=10")
    source = build_prompt_source(config.data, seed=config.seed, tokenizer=TOKENIZER)
    assert isinstance(source, CustomSource)
    first = source.next_batch(3)
    assert [(s.group_index, s.label) for s in first] == [(0, "11"), (1, "12"), (2, "13")]
    state = json.loads(json.dumps(source.state_dict()))
    resumed = build_prompt_source(config.data, seed=config.seed, tokenizer=TOKENIZER)
    resumed.load_state_dict(state)
    assert [(s.group_index, s.label) for s in resumed.next_batch(2)] == [(3, "14"), (4, "15")]
    with pytest.raises(ValueError, match="saved by source 'other:Source'"):
        resumed.load_state_dict(state | {"source": "other:Source"})


def test_step_hooks_filter_regroup_log_and_hand_back_dropped_prompts(config_dir):
    config = load(
        config_dir,
        "--rollout.sample_filter=ext_user_code:keep_long",
        "--rollout.post_process=ext_user_code:regroup",
        "--logging.rollout_log_function=ext_user_code:log",
    )
    consumed = []
    run = SimpleNamespace(config=config, rollout=SimpleNamespace(consumed=consumed.extend))
    groups = []
    for draw, responses in enumerate([["7"], ["78", "7"], ["77", "79", "8"]]):
        group = samples(responses)
        for sample in group:
            sample.group_index = draw
        groups.append(group)
    kept, metrics = apply_step_hooks(run, 3, groups, {"rollout/x": 1.0})
    # the filter leaves [], ["78"], ["77", "79"]; post_process drops the first group it sees
    # and keeps one sample of the others
    assert [[s.response for s in g] for g in kept] == [["77"]]
    assert metrics == {
        "rollout/x": 1.0,
        "rollout/samples_filtered": 3.0,
        "user/groups": 1.0,
        "user/step": 3.0,
    }
    assert sorted(g[0].group_index for g in consumed) == [0, 1]


def test_a_log_function_must_return_numbers(config_dir):
    config = load(config_dir, "--logging.rollout_log_function=ext_user_code:bad_log")
    run = SimpleNamespace(config=config, rollout=SimpleNamespace())
    with pytest.raises(ValueError, match="metric 'user/text' is 'x'"):
        apply_step_hooks(run, 1, [samples(["7"])], {})
