"""User functions by dotted path wherever a registry or an aggregation mode takes a name:
imported, signature-checked at load (a function that cannot be called as the built-ins are
is refused naming the expected signature), and used by the objective as a built-in is."""

import pytest
import torch

from rl_core.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs
from rl_core.aggregation import aggregate
from rl_core.filters import GROUP_FILTERS
from rl_core.objective import Objective, objective_loss

HERE = "test_dotted_paths"  # this module, importable by name under pytest


def reinforce_loss(log_probs, old_log_probs, advantages, mask, *, clip_low, clip_high, **_):
    """-A * log pi per token, never clipped."""
    return -advantages * log_probs, torch.zeros_like(log_probs)


def two_args_loss(log_probs, advantages):
    return log_probs, log_probs


def token_sum(per_token, mask, *, cu_seqlens, num_tokens, num_seqs, norm_length):
    return (per_token * mask).sum()


def keep_if_first_positive(rewards):
    return rewards[0] > 0


def constant_advantage(inputs: AdvantageInputs):
    advantages = inputs.mask.float() * 2.0
    return advantages, advantages


def test_a_dotted_policy_loss_and_reducer_make_the_objective():
    objective = Objective(policy_loss=f"{HERE}:reinforce_loss", loss_agg_mode=f"{HERE}:token_sum")
    log_probs = torch.tensor([[-1.0, -2.0], [-0.5, -4.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    advantages = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    loss, metrics = objective_loss(
        objective,
        log_probs=log_probs,
        mask=mask,
        old_log_probs=log_probs.detach(),
        advantages=advantages,
    )
    # -(1 * -1) - (1 * -2) - (-2 * -0.5) = 1 + 2 - 1; the masked token adds nothing
    assert float(loss.detach()) == pytest.approx(2.0)
    assert metrics["pg/clipfrac"] == 0.0
    loss.backward()
    assert log_probs.grad.tolist() == [[-1.0, -1.0], [2.0, 0.0]]


def test_a_reducer_gets_the_global_denominators():
    seen = {}

    def spy(per_token, mask, **denominators):
        seen.update(denominators)
        return per_token.sum()

    import test_dotted_paths

    test_dotted_paths.spy = spy
    value = aggregate(torch.ones(2, 3), torch.ones(2, 3), mode=f"{HERE}:spy", num_tokens=12.0)
    assert float(value) == 6.0
    assert seen == {"cu_seqlens": None, "num_tokens": 12.0, "num_seqs": None, "norm_length": None}


def test_filters_and_estimators_by_dotted_path():
    keep = GROUP_FILTERS.get(f"{HERE}:keep_if_first_positive")
    assert keep([1.0, 0.0]) and not keep([0.0, 1.0])
    estimator = ADVANTAGE_ESTIMATORS.get(f"{HERE}:constant_advantage")
    inputs = AdvantageInputs(rewards=torch.zeros(2), mask=torch.tensor([[1, 0], [1, 1]]))
    advantages, _ = estimator(inputs)
    assert advantages.tolist() == [[2.0, 0.0], [2.0, 2.0]]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"policy_loss": f"{HERE}:two_args_loss"}, r"policy loss .*two_args_loss.*expected fn\("),
        ({"loss_agg_mode": f"{HERE}:reinforce_loss"}, r"loss aggregation .*expected fn\("),
        ({"policy_loss": "no_such_module_here:loss"}, r"cannot import 'no_such_module_here'"),
        ({"policy_loss": f"{HERE}:missing"}, r"has no 'missing'"),
        ({"policy_loss": f"{HERE}:HERE"}, r"is str, not a function"),
        ({"policy_loss": "reinforce"}, r"or a dotted path 'pkg.module:function'"),
    ],
)
def test_bad_dotted_paths_are_refused_when_the_objective_is_built(options, message):
    with pytest.raises(ValueError, match=message):
        Objective(**options)


def test_a_filter_that_takes_no_rewards_is_refused():
    with pytest.raises(ValueError, match=r"expected fn\(rewards: Sequence\[float\]\) -> bool"):
        GROUP_FILTERS.get(f"{HERE}:two_args_loss")
