"""Registry: names, errors listing the valid choices, dotted-path user functions."""

import pickle

import pytest

from rl_rewards import get_reward, list_rewards, register_reward

EXPECTED = {
    "math",
    "dapo",
    "deepscaler",
    "gpqa",
    "f1",
    "exact_match",
    "prefix_match",
    "gsm8k",
    "ifeval",
    "code",
    "remote",
    "weighted_sum",
    "format",
    "overlong",
}


def test_every_builtin_reward_is_listed_with_a_description():
    specs = {spec.name: spec for spec in list_rewards()}
    assert set(specs) >= EXPECTED
    assert all(spec.description for spec in specs.values())


def test_unknown_name_raises_value_error_listing_valid_names():
    with pytest.raises(ValueError, match="unknown reward 'maths'") as info:
        get_reward("maths")
    for name in EXPECTED:
        assert name in str(info.value)


def test_duplicate_registration_is_rejected():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math", "again")(lambda response, label: 0.0)


def test_dotted_path_loads_a_user_function_with_options():
    reward = get_reward("reward_helpers:length_reward", scale=2.0)
    assert reward("abc", None) == 6.0
    assert get_reward("reward_helpers.length_reward")("ab", None) == 2.0


@pytest.mark.parametrize(
    "path", ["reward_helpers:missing", "no_such_module:f", "reward_helpers:NOT_CALLABLE", ":f"]
)
def test_bad_dotted_paths_raise_value_error(path):
    with pytest.raises(ValueError):
        get_reward(path)


def test_rewards_with_options_are_picklable_for_worker_processes():
    reward = pickle.loads(pickle.dumps(get_reward("math", rel_tol=0.1)))
    assert reward("\\boxed{3.1}", "\\pi") == 1.0
