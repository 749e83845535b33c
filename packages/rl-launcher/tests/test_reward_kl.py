"""The KL-shaped reward (algorithm.reward_kl_coef): the buffer's advantages with the
per-token KL of the step's old log-probs to the reference's, with hand values."""

from types import SimpleNamespace

import pytest
import torch

from rl_core.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs, whiten
from rl_core.types import Sample
from rl_launcher.data.buffer import DataBuffer
from rl_launcher.roles.critic import GaeBuffer
from rl_launcher.roles.reference import with_reference
from rl_launcher.roles.train_group import with_old_log_probs

COEF = 0.1
# per sample: tokens, response length, reward, k1 KL (old - ref) of each response token
SAMPLES = [
    ([1, 2, 3, 4], 2, 1.0, [0.5, -0.2]),
    ([1, 2, 5], 1, 0.0, [0.3]),
    ([6, 7, 8], 2, 0.0, [0.1, 0.4]),
    ([6, 9], 1, 1.0, [-0.6]),
]
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
KL = torch.tensor([[0.5, -0.2], [0.3, 0.0], [0.1, 0.4], [-0.6, 0.0]])
# REINFORCE++ returns by hand: token reward -0.1 * KL, plus the reward on the last token
RETURNS = torch.tensor([[-0.05 + 1.02, 1.02], [-0.03, 0.0], [-0.01 - 0.04, -0.04], [1.06, 0.0]])
OLD = -1.0  # old log-prob of every response token; the reference's is OLD - KL


def samples() -> list[Sample]:
    return [
        Sample(tokens=tokens, response_length=n, reward=reward, group_index=i // 2, index=i % 2)
        for i, (tokens, n, reward, _) in enumerate(SAMPLES)
    ]


def log_probs(step, *, ref: bool) -> list[torch.Tensor]:
    """Packed ``[N]`` log-probs of each rank batch; positions that predict no response token
    hold 9.0 (old) and -9.0 (ref), which would show in the KL if they were read."""
    out = []
    for part in step.partitions:
        values = []
        for i in part:
            tokens, n, _, kl = SAMPLES[i]
            response = [OLD - k if ref else OLD for k in kl]
            prompt = len(tokens) - n
            values += [(-9.0 if ref else 9.0)] * (prompt - 1) + response + [-9.0 if ref else 9.0]
        out.append(torch.tensor(values))
    return out


def filled(buffer: DataBuffer):
    """Pop one step of SAMPLES and fill its advantages as the loop does."""
    buffer.add(samples())
    step = buffer.pop_step(2)
    assert all(b.advantages is None for b in step.rank_batches)  # left for the KL
    rank_batches = with_old_log_probs(step.rank_batches, log_probs(step, ref=False))
    return step, buffer.fill_advantages(step, rank_batches, log_probs(step, ref=True))


def by_sample(step, rank_batches, name: str) -> torch.Tensor:
    """``[B, T]`` response values of field ``name`` gathered back from the rank batches."""
    rows = torch.zeros(len(step.samples), 2)
    for part, batch in zip(step.partitions, rank_batches, strict=True):
        values, offset = getattr(batch, name), 0
        for i in part:
            sample = step.samples[i]
            start = offset + sample.prompt_length - 1
            rows[i, : sample.response_length] = values[start : start + sample.response_length]
            offset += len(sample.tokens)
    return rows


def test_reinforce_pp_advantages_carry_the_kl_penalty():
    buffer = DataBuffer(
        group_size=2, num_ranks=2, advantage_estimator="reinforce_plus_plus", reward_kl_coef=COEF
    )
    step, rank_batches = filled(buffer)
    assert step.partitions == [[1, 2], [0, 3]]  # 3 + 3 and 4 + 2 tokens: both ranks mapped
    got = by_sample(step, rank_batches, "advantages")
    torch.testing.assert_close(got, whiten(RETURNS, MASK))  # hand returns, whitened
    inputs = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), mask=MASK, kl=KL, kl_coef=COEF, group_size=2
    )
    expected, _ = ADVANTAGE_ESTIMATORS.get("reinforce_plus_plus")(inputs)
    torch.testing.assert_close(got, expected)
    for batch in rank_batches:  # nothing outside the response tokens
        assert (batch.advantages[batch.loss_mask == 0] == 0).all()
    assert step.metrics["algorithm/reward_kl_mean"] == pytest.approx(0.5 / 6)

    plain = DataBuffer(group_size=2, num_ranks=2, advantage_estimator="reinforce_plus_plus")
    plain.add(samples())
    no_kl = by_sample(step, plain.pop_step(2).rank_batches, "advantages")
    torch.testing.assert_close(
        no_kl, whiten(torch.tensor([[1.0, 1], [0, 0], [0, 0], [1, 0]]), MASK)
    )
    assert (got - no_kl).abs().max() > 0.05  # the KL moved the advantages


def test_reinforce_pp_baseline_subtracts_the_kl_per_token():
    buffer = DataBuffer(
        group_size=2,
        num_ranks=1,
        advantage_estimator="reinforce_plus_plus_baseline",
        reward_kl_coef=COEF,
    )
    step, rank_batches = filled(buffer)
    centred = torch.tensor([[0.5, 0.5], [-0.5, 0], [-0.5, -0.5], [0.5, 0]])  # r - group mean
    got = by_sample(step, rank_batches, "advantages")
    torch.testing.assert_close(got, whiten((centred - COEF * KL) * MASK, MASK))


def test_gae_gets_the_kl_and_the_critic_its_targets():
    values = torch.tensor([[0.2, 0.4], [0.1, 0.0], [0.3, -0.1], [0.5, 0.0]])
    buffer = GaeBuffer(
        value_fn=lambda samples: values,
        group_size=2,
        num_ranks=2,
        advantage_estimator="gae",
        reward_kl_coef=COEF,
        lam=1.0,
    )
    step, rank_batches = filled(buffer)
    # gamma = lam = 1: the return of a token is the sum of the token rewards from it on
    torch.testing.assert_close(by_sample(step, rank_batches, "returns"), RETURNS * MASK)
    torch.testing.assert_close(by_sample(step, rank_batches, "old_values"), values * MASK)
    advantages = whiten((RETURNS - values) * MASK, MASK)
    torch.testing.assert_close(by_sample(step, rank_batches, "advantages"), advantages)
    assert step.metrics["critic/returns_mean"] == pytest.approx(float(RETURNS.sum()) / 6)


def test_no_reference_call_without_a_kl_and_one_with_it():
    calls = []

    def trainer_log_probs(batches, model="actor"):
        calls.append(model)
        return [torch.zeros(b.num_tokens) for b in batches]

    def run(kl_coef, reward_kl_coef):
        algorithm = SimpleNamespace(kl_coef=kl_coef, reward_kl_coef=reward_kl_coef)
        return SimpleNamespace(
            config=SimpleNamespace(algorithm=algorithm),
            trainer=SimpleNamespace(log_probs=trainer_log_probs),
        )

    plain = DataBuffer(group_size=2, num_ranks=1, advantage_estimator="reinforce_plus_plus")
    plain.add(samples())
    step = plain.pop_step(2)
    assert step.rank_batches[0].advantages is not None  # computed at once, as before
    assert with_reference(run(0.0, 0.0), plain, step, step.rank_batches) is step.rank_batches
    assert calls == []
    in_loss = with_reference(run(0.01, 0.0), plain, step, step.rank_batches)
    assert calls == ["ref"] and in_loss[0].ref_log_probs is not None
    shaped = DataBuffer(
        group_size=2, num_ranks=1, advantage_estimator="reinforce_plus_plus", reward_kl_coef=COEF
    )
    shaped.add(samples())
    step = shaped.pop_step(2)
    batches = with_old_log_probs(step.rank_batches, [torch.zeros(step.rank_batches[0].num_tokens)])
    (batch,) = with_reference(run(0.0, COEF), shaped, step, batches)
    assert calls == ["ref", "ref"] and batch.ref_log_probs is None  # the loss has no KL
    assert batch.advantages is not None and step.metrics["algorithm/reward_kl_mean"] == 0.0
