"""Every kind of user code rl-train takes by dotted path, on the quickstart's additions
(docs/extending.md explains each; config.yaml switches them on together).
rl-train finds this module because it sits next to the config."""

import asyncio
import copy
import random

import torch

from rl_core.types import Sample
from rl_sglang.rollout.generate import generate_sample


class AdditionSource:
    """data.source: endless seeded "a+b=" prompts with a and b in the metadata."""

    def __init__(self, data, *, seed: int, tokenizer):
        self.tokenizer, self.seed, self.drawn = tokenizer, seed, 0

    def next_prompt(self) -> Sample:
        rng = random.Random(f"{self.seed}/{self.drawn}")
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        self.drawn += 1
        text = f"{a}+{b}="
        tokens = list(self.tokenizer.encode(text, add_special_tokens=False))
        return Sample(prompt=text, tokens=tokens, label=str(a + b), metadata={"a": a, "b": b})

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]


async def two_answers(ctx, sample: Sample, sampling_params: dict) -> list[Sample]:
    """rollout.function: two answers per sample (fan-out); both join the prompt's group."""
    twin = copy.deepcopy(sample)
    twin.metadata["rid"] = f"{sample.metadata.get('rid')}-twin"
    return list(
        await asyncio.gather(
            generate_sample(ctx, sample, sampling_params),
            generate_sample(ctx, twin, sampling_params),
        )
    )


def digit_reward(sample: Sample, *, wrong: float = 0.0) -> float:
    """rollout.reward taking the whole Sample: the sum from the metadata, not the label."""
    expected = sample.metadata["a"] + sample.metadata["b"]
    return 1.0 if sample.response.strip() == str(expected) else wrong


def rank_in_group(samples: list[Sample]) -> list[float]:
    """rollout.group_reward: 1 for a correct answer, plus 0.5 for being the group's only one."""
    correct = [s.response.strip() == s.label for s in samples]
    alone = sum(correct) == 1
    return [float(c) + (0.5 if c and alone else 0.0) for c in correct]


def answered(sample: Sample) -> bool:
    """rollout.sample_filter: an empty response (an immediate end of text) is left out."""
    return bool(sample.response.strip())


def at_most_six(groups: list[list[Sample]]) -> list[list[Sample]]:
    """rollout.post_process: at most six samples of each group train."""
    return [group[:6] for group in groups]


def addition_metrics(step: int, groups: list[list[Sample]]) -> dict[str, float]:
    """logging.rollout_log_function: extra metrics of the step."""
    samples = [s for group in groups for s in group]
    return {
        "extend/group_size_mean": len(samples) / max(len(groups), 1),
        "extend/correct_frac": sum(s.response.strip() == s.label for s in samples)
        / max(len(samples), 1),
    }


def mean_baseline(inputs):
    """algorithm.advantage_estimator: reward minus its group's mean (no std scaling)."""
    sizes = list(
        inputs.group_sizes or [inputs.group_size] * (len(inputs.rewards) // inputs.group_size)
    )
    centred = torch.cat([g - g.mean() for g in torch.split(inputs.rewards, sizes)])
    advantages = centred.unsqueeze(-1) * inputs.mask.to(centred.dtype)
    return advantages, advantages


def ratio_pg_loss(
    log_probs, old_log_probs, advantages, mask, *, clip_low, clip_high, dual_clip, cu_seqlens
):
    """algorithm.policy_loss: -A x ratio, unclipped (clipfrac 0)."""
    ratio = torch.exp(log_probs - old_log_probs)
    return -advantages * ratio, torch.zeros_like(log_probs)


def token_mean(per_token, mask, *, cu_seqlens, num_tokens, num_seqs, norm_length):
    """algorithm.loss_agg_mode: the sum over valid tokens by the step's global token count."""
    weights = mask.to(per_token.dtype)
    return (per_token * weights).sum() / max(float(num_tokens or weights.sum()), 1.0)


def has_rewards(rewards) -> bool:
    """algorithm.group_filter: keeps every group that scored at least one sample."""
    return len(rewards) > 0
