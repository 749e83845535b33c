"""Rollout functions against the real cluster: dynamic sampling with over-sampling and
aborted leftovers, partial-rollout resume, a custom generate function by dotted path,
evaluation pass@k and the multi-turn calculator's token bookkeeping."""

import asyncio
import copy
from dataclasses import replace

import pytest

from conftest import run, teacher_forced_logprobs
from rl_core.metrics import pass_at_k_groups
from rl_core.types import Sample, SampleStatus
from rl_sglang.client import EngineClient
from rl_sglang.rollout.default import RolloutConfig, default_rollout, make_groups
from rl_sglang.rollout.eval import eval_rollout
from rl_sglang.rollout.generate import GenerateContext, generate_sample, load_function
from rl_sglang.rollout.multiturn import CalculatorTool, calculate
from rl_sglang.rollout.rewards import GroupScore
from rl_sglang.transports import update_from_tensor

pytestmark = pytest.mark.integration


async def budget_generate(ctx, sample, sampling_params):
    """A custom generate function: the sample's metadata sets its token budget."""
    budget = sample.metadata.get("budget", sampling_params["max_new_tokens"])
    return await generate_sample(ctx, sample, {**sampling_params, "max_new_tokens": budget})


SHORT_DONE: dict[str, asyncio.Event] = {}


async def late_generate(ctx, sample, sampling_params):
    """Short samples finish in 3 tokens and say so; long ones send their request only
    0.2 s after that, so it reaches the engine after the rollout's first abort."""
    done = SHORT_DONE.setdefault("event", asyncio.Event())
    if sample.metadata.get("short"):
        result = await generate_sample(ctx, sample, {**sampling_params, "max_new_tokens": 3})
        done.set()
        return result
    await done.wait()
    await asyncio.sleep(0.2)
    return await generate_sample(ctx, sample, sampling_params)


async def two_answers(ctx, sample, sampling_params):
    """A generate function that fans out: two responses for one sample."""
    twin = copy.deepcopy(sample)
    twin.metadata["rid"] = f"{sample.metadata['rid']}-twin"
    first = await generate_sample(ctx, sample, sampling_params)
    return [first, await generate_sample(ctx, twin, sampling_params)]


def parity_reward(sample: Sample) -> float:
    return float(sample.tokens[sample.prompt_length] % 2 == 0)


def prompts(count, **metadata):
    return [Sample(prompt=f"question {i}:", label=i, metadata=dict(metadata)) for i in range(count)]


async def with_ctx(cluster, tokenizer, fn, **ctx_kwargs):
    router = EngineClient(cluster.router.url)
    engines = [EngineClient(url) for url in cluster.engine_urls]
    try:
        return await fn(GenerateContext(client=router, tokenizer=tokenizer, **ctx_kwargs), engines)
    finally:
        for client in [router, *engines]:
            await client.close()


def test_dynamic_sampling_fills_the_batch_with_informative_groups(cluster, tokenizer, tiny_model):
    config = RolloutConfig(
        num_groups=3,
        n_samples_per_prompt=4,
        group_filter="nonzero_std",
        sampling_params={"max_new_tokens": 5, "ignore_eos": True},
    )
    result = run(
        with_ctx(
            cluster,
            tokenizer,
            lambda ctx, engines: default_rollout(
                ctx, iter(prompts(40)), parity_reward, config, engines=engines
            ),
        )
    )
    assert len(result.groups) == 3
    for group in result.groups:
        rewards = [s.reward for s in group]
        assert len(group) == 4 and 0 < sum(rewards) < 4  # nonzero std
        assert len({s.group_index for s in group}) == 1
        for sample in group:
            sample.validate()
            assert sample.status is SampleStatus.TRUNCATED and sample.response_length == 5
            assert sample.tokens[: sample.prompt_length] == tokenizer.encode(sample.prompt)
            expected = teacher_forced_logprobs(
                tiny_model,
                sample.tokens[: sample.prompt_length],
                sample.tokens[sample.prompt_length :],
            )
            assert sample.rollout_log_probs == pytest.approx(expected, abs=1e-4)
            assert len(sample.weight_versions) == 1
    assert result.metrics["rollout/groups_launched"] >= 3 + result.metrics["rollout/groups_dropped"]


def test_leftovers_are_aborted_and_resume_as_partial_rollouts(cluster, tokenizer, tiny_model):
    # one short group fills the batch; long groups are still running and get aborted
    source = prompts(1, budget=3) + prompts(3, budget=4000)
    config = RolloutConfig(
        num_groups=1,
        n_samples_per_prompt=2,
        partial_rollout=True,
        offpolicy_tokens="mask",
        generate_fn="test_rollout:budget_generate",
        sampling_params={"max_new_tokens": 4000, "ignore_eos": True},
    )

    async def go(ctx, engines):
        first = await default_rollout(ctx, iter(source), lambda s: 1.0, config, engines=engines)
        aborted = [s.status is SampleStatus.ABORTED for g in first.leftovers for s in g]
        partial_lengths = {s.index: s.response_length for g in first.leftovers for s in g}
        for group in first.leftovers:  # finish them quickly this time
            for sample in group:
                sample.metadata["budget"] = sample.response_length + 3
        # a weight sync in between (same weights, new version) makes the old part stale
        await update_from_tensor(
            engines, list(tiny_model.state_dict().items()), weight_version="resumed-v"
        )
        second = await default_rollout(
            ctx, iter([]), lambda s: 1.0, config, engines=engines, resume=first.leftovers
        )
        return first, aborted, partial_lengths, second

    first, aborted, partial_lengths, second = run(with_ctx(cluster, tokenizer, go))
    assert len(first.groups) == 1 and first.groups[0][0].response_length == 3
    assert aborted and all(aborted) and len(aborted) == 6
    assert any(n > 0 for n in partial_lengths.values())
    resumed = [s for g in second.groups for s in g]
    assert resumed and {s.status for s in resumed} == {SampleStatus.TRUNCATED}
    for sample in resumed:
        sample.validate()
        old = partial_lengths[sample.index]
        assert sample.response_length == old + 3
        if old:
            assert sample.metadata["resumed"] == 1
            assert sample.loss_mask == [0] * old + [1] * 3  # off-policy part masked
            assert sample.weight_versions[-1] == "resumed-v" and len(sample.weight_versions) == 2


def test_a_request_sent_after_the_abort_is_aborted_too(cluster, tokenizer):
    # the long groups' requests are on their way when the batch fills; one abort would
    # miss them and they would run their 4000 tokens
    source = prompts(1, short=True) + prompts(2)
    config = RolloutConfig(
        num_groups=1,
        n_samples_per_prompt=2,
        partial_rollout=True,
        generate_fn="test_rollout:late_generate",
        sampling_params={"max_new_tokens": 4000, "ignore_eos": True},
    )

    async def go(ctx, engines):
        SHORT_DONE["event"] = asyncio.Event()  # this loop's
        return await default_rollout(ctx, iter(source), lambda s: 1.0, config, engines=engines)

    result = run(with_ctx(cluster, tokenizer, go))
    assert len(result.groups) == 1 and result.groups[0][0].response_length == 3
    late = [s for g in result.leftovers for s in g]
    assert len(late) == 4 and {s.status for s in late} == {SampleStatus.ABORTED}
    assert all(s.response_length < 4000 for s in late)


def test_custom_generate_function_by_dotted_path():
    assert load_function("test_rollout:budget_generate") is budget_generate
    assert load_function("rl_sglang.rollout.multiturn.generate_with_calculator")
    with pytest.raises(ValueError, match="cannot load"):
        load_function("rl_sglang.rollout.nothing:here")
    with pytest.raises(ValueError, match="unknown group filter"):
        RolloutConfig(num_groups=1, group_filter="bogus")


def test_a_group_reward_scores_each_fanned_out_group_once_whole(cluster, tokenizer):
    calls = []

    async def rank_in_group(samples: list[Sample]) -> None:
        calls.append(len(samples))
        for i, sample in enumerate(samples):
            sample.reward = float(i)

    config = RolloutConfig(
        num_groups=2,
        n_samples_per_prompt=3,
        generate_fn="test_rollout:two_answers",
        sampling_params={"max_new_tokens": 2, "ignore_eos": True},
    )
    result = run(
        with_ctx(
            cluster,
            tokenizer,
            lambda ctx, engines: default_rollout(
                ctx, iter(prompts(2)), GroupScore(rank_in_group), config, engines=engines
            ),
        )
    )
    assert calls == [6, 6]  # once per group, after all six samples finished
    for group in result.groups:
        assert [s.reward for s in group] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert all(s.response_length == 2 for s in group)
        assert len({s.group_index for s in group}) == 1


def test_eval_rollout_reports_pass_at_k_per_dataset(cluster, tokenizer):
    datasets = {"odd": prompts(3), "even": prompts(2)}
    metrics, groups = run(
        with_ctx(
            cluster,
            tokenizer,
            lambda ctx, _: eval_rollout(
                ctx,
                datasets,
                parity_reward,
                n_samples_per_prompt=4,
                ks=(1, 2, 4),
                sampling_params={"max_new_tokens": 2, "ignore_eos": True},
            ),
        )
    )
    for name in datasets:
        correct = [[s.reward >= 1.0 for s in g] for g in groups[name]]
        expected = pass_at_k_groups(correct, (1, 2, 4))
        for k in (1, 2, 4):
            assert metrics[f"eval/{name}/pass@{k}"] == pytest.approx(expected[f"pass@{k}"])
        assert metrics[f"eval/{name}/pass@1"] <= metrics[f"eval/{name}/pass@4"]
        assert metrics[f"eval/{name}/truncated_frac"] == 1.0


def test_calculator():
    assert calculate("2*(3+4)") == "14"
    assert calculate(" 7 / 2 ") == "3.5"
    assert calculate("-2**3") == "-8"
    assert calculate("__import__('os')").startswith("error")
    assert calculate("1/0") == "error: ZeroDivisionError"


def test_multi_turn_token_bookkeeping(cluster, tokenizer, tiny_model):
    prompt = "calc:"
    prompt_ids = tokenizer.encode(prompt)

    async def go(ctx, _):
        first = await ctx.client.generate(
            input_ids=prompt_ids, sampling_params={"max_new_tokens": 1, "temperature": 0}
        )
        tool = CalculatorTool(
            call_end=first["output_ids"][0], max_turns=2
        )  # the first token "calls" the tool
        params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        return await tool(ctx, Sample(prompt=prompt), params)

    sample = run(with_ctx(cluster, tokenizer, go))
    sample.validate()
    tool_ids = tokenizer.encode("<result>error: no <calc> expression</result>")
    response = sample.tokens[len(prompt_ids) :]
    assert sample.metadata["tool_calls"] >= 1
    assert response[1 : 1 + len(tool_ids)] == tool_ids
    assert sample.loss_mask[: 1 + len(tool_ids)] == [1] + [0] * len(tool_ids)
    assert sample.rollout_log_probs[1 : 1 + len(tool_ids)] == [0.0] * len(tool_ids)
    # model tokens' log-probs equal a teacher-forced forward over the whole token sequence
    reference = teacher_forced_logprobs(tiny_model, prompt_ids, response)
    for mask, got, want in zip(sample.loss_mask, sample.rollout_log_probs, reference, strict=True):
        if mask:
            assert got == pytest.approx(want, abs=1e-4)
    assert asyncio.iscoroutinefunction(CalculatorTool.__call__)


class CountingClient(EngineClient):
    """The real client, recording every /generate body it sends."""

    def __init__(self, url):
        super().__init__(url)
        self.bodies = []

    async def generate(self, **body):
        self.bodies.append(body)
        return await super().generate(**body)


def test_seeded_prompts_give_the_same_samples_however_requests_are_batched(cluster, tokenizer):
    """Templates seeded through ``metadata["sampling_seed"]``: once as one n-request per
    group, all in flight together; once sample by sample (a custom generate function), one
    request at a time. Every sample gets the same tokens both ways, and seeds
    base + i tell a group's samples apart."""
    params = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 1.0}
    seeds = [1234567890123, 98765, 2**62 - 1]

    def seeded_prompts():
        return iter(
            [
                Sample(prompt=f"question {i}:", label=i, metadata={"sampling_seed": seed})
                for i, seed in enumerate(seeds)
            ]
        )

    def responses(**options):
        config = RolloutConfig(
            num_groups=3, n_samples_per_prompt=4, sampling_params=params, **options
        )
        result = run(
            with_ctx(
                cluster,
                tokenizer,
                lambda ctx, _: default_rollout(ctx, seeded_prompts(), parity_reward, config),
            )
        )
        samples = sorted((s for g in result.groups for s in g), key=lambda s: s.index)
        assert [s.metadata["sampling_seed"] for s in samples] == [
            seed + i for seed in seeds for i in range(4)
        ]
        return [tuple(s.tokens[s.prompt_length :]) for s in samples]

    together = responses()
    alone = responses(generate_fn="test_rollout:budget_generate", max_concurrency=1)
    assert together == alone
    assert len(set(together)) >= 10  # 12 samples, 6 tokens each: seeds differ, so do they


def test_fresh_groups_go_as_one_n_request_mapped_back_in_order(cluster, tokenizer, tiny_model):
    params = {"max_new_tokens": 4, "ignore_eos": True, "sampling_seed": 7}
    config = RolloutConfig(num_groups=2, n_samples_per_prompt=4, sampling_params=params)

    async def go():
        router = CountingClient(cluster.router.url)
        try:
            ctx = GenerateContext(client=router, tokenizer=tokenizer)

            async def reward(sample):  # awaited rewards are gathered for the whole group
                return parity_reward(sample)

            result = await default_rollout(ctx, iter(prompts(2)), reward, config)
            grouped_bodies = list(router.bodies)
            per_sample = replace(config, group_requests=False)  # one request a sample
            apart = await default_rollout(ctx, iter(prompts(2)), reward, per_sample)
            apart_bodies = router.bodies[len(grouped_bodies) :]
            singles = [  # sample i of an n request is seeded sampling_seed + i
                await router.generate(
                    input_ids=tokenizer.encode("question 0:"),
                    return_logprob=True,
                    sampling_params={**params, "sampling_seed": 7 + i},
                )
                for i in range(4)
            ]
            return result, grouped_bodies, singles, apart, apart_bodies
        finally:
            await router.close()

    result, bodies, singles, apart, apart_bodies = run(go())
    assert [b["sampling_params"]["n"] for b in bodies[:2]] == [4, 4]  # one request per group
    assert len(apart_bodies) == 8 and all("n" not in b["sampling_params"] for b in apart_bodies)
    assert sorted(len(g) for g in apart.groups) == [4, 4]
    assert all(s.reward == parity_reward(s) for g in apart.groups for s in g)
    assert len({tuple(single["output_ids"]) for single in singles}) > 1  # seeds tell them apart
    group = next(g for g in result.groups if g[0].label == 0)
    body = next(b for b in bodies[:2] if b["input_ids"] == tokenizer.encode("question 0:"))
    assert [s.index for s in group] == [0, 1, 2, 3] and {s.group_index for s in group} == {0}
    for i, (sample, single) in enumerate(zip(group, singles, strict=True)):
        assert sample.tokens[sample.prompt_length :] == single["output_ids"]
        assert sample.status is SampleStatus.TRUNCATED and sample.reward == parity_reward(sample)
        assert sample.metadata["rid"] == f"{body['rid']}-{i}"
        assert sample.weight_versions == [single["meta_info"]["weight_version"]]
        expected = teacher_forced_logprobs(
            tiny_model, sample.tokens[: sample.prompt_length], single["output_ids"]
        )
        assert sample.rollout_log_probs == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("extra", [None, lambda: 1])  # a lambda cannot be pickled: deepcopy
def test_group_copies_are_independent_and_numbered(extra):
    template = Sample(prompt="q", tokens=[1, 2], metadata={"nested": {"a": [1]}, "f": extra})
    first, second = make_groups(iter([template, template]), 3, start_index=5)
    assert [(s.group_index, s.index) for s in first + second] == [
        (5, 15),
        (5, 16),
        (5, 17),
        (6, 18),
        (6, 19),
        (6, 20),
    ]
    first[0].tokens.append(3)
    first[0].metadata["nested"]["a"].append(2)
    for sample in [*first[1:], *second, template]:
        assert sample.tokens == [1, 2] and sample.metadata["nested"] == {"a": [1]}
    assert first[1].metadata["f"] is extra
