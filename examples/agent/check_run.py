"""Check a run of config.yaml's recorded trajectories against what the engine sampled, step
by step (the checks behind README.md's "Why the first runs collapsed").

    AGENT_LOG=replies.jsonl ... rl-train --config examples/agent/config.yaml \
        --checkpoint.interval 1 --checkpoint.keep_last 100 --checkpoint.save_hf true
    uv run --package rl-launcher python examples/agent/check_run.py RUN_DIR DUMPS \
        --replies replies.jsonl --start runs/agent_sft/checkpoints/step_000100/hf

Per step it reports: samples whose trained (mask 1) tokens are not the engine's reply ids
(from ``AGENT_LOG``, in order); samples whose untrained tokens are not the chat template's
rendering of the tool turns and generation prompts; the largest gap between the engine's
log-probs and an independent Hugging Face forward of the recorded tokens under the weights
that sampled them (``RUN_DIR/checkpoints/step_N/hf``, ``--start`` for version 0); the
GRPO advantages (group-centred, divided by the group's std); the mean log-prob the policy
gives a whole well-formed calculator call (``data/sft.jsonl``'s call turns), which falls
when an update breaks the call format; and what the step's update did on the step's own
trained tokens (the weights of the next version): the mean |change| of their log-probs
and the token-mean of advantage x change, the surrogate GRPO raises.
"""

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = Path(__file__).parent


def load_replies(path: Path) -> dict[str, list[list[int]]]:
    replies: dict[str, list[list[int]]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        replies.setdefault(record["session"], []).append(record["token_ids"])
    return replies


def mask_runs(response: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    """``[(mask value, tokens), ...]``: the response cut where the mask changes."""
    runs: list[tuple[int, list[int]]] = []
    for token, bit in zip(response, mask, strict=True):
        if runs and runs[-1][0] == bit:
            runs[-1][1].append(token)
        else:
            runs.append((bit, [token]))
    return runs


def untrained_is_template(tokenizer, sample: dict, tools) -> bool:
    """The prompt and every untrained run between two replies decode to exactly what the
    chat template writes there: the tool turn and the next generation prompt, after the
    newline ChatML puts behind an end-of-turn (and the end-of-turn itself when the reply
    was cut at max_response_tokens without one)."""
    messages = _for_template(sample["metadata"]["messages"])

    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages[:upto], tools=tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    p = len(sample["tokens"]) - sample["response_length"]
    runs = mask_runs(sample["tokens"][p:], sample["loss_mask"])
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    replies = [run for bit, run in runs if bit]
    expected = [render(turns[0], True)]
    for reply, i, j in zip(replies, turns, turns[1:], strict=False):
        ended = reply[-1] == tokenizer.eos_token_id
        glue = "\n" if ended else tokenizer.eos_token + "\n"
        expected.append(glue + render(j, True)[len(render(i + 1, False)) :])
    found = [tokenizer.decode(sample["tokens"][:p])]
    found += [tokenizer.decode(run) for bit, run in runs if not bit]
    return found == expected


def _for_template(messages):
    from rl_sglang.agent.sessions import for_template

    return for_template(messages)


@torch.no_grad()
def token_log_probs(model, tokens: list[int], temperature: float) -> torch.Tensor:
    """Log-probs of ``tokens[1:]`` under the sampling distribution (logits / temperature,
    as the engine reports them and the trainer computes them)."""
    ids = torch.tensor([tokens])
    logits = model(ids).logits.float()[0, :-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]


def trained_log_probs(model, sample: dict, temperature: float) -> list[tuple[float, float]]:
    """``(model's, engine's)`` log-prob of each trained token of ``sample``."""
    p = len(sample["tokens"]) - sample["response_length"]
    mine = token_log_probs(model, sample["tokens"], temperature)[p - 1 :].tolist()
    pairs = zip(mine, sample["rollout_log_probs"], sample["loss_mask"], strict=True)
    return [(m, e) for m, e, bit in pairs if bit]


def grpo_advantages(samples: list[dict]) -> list[float]:
    """Each sample's GRPO advantage: its reward minus its group's mean, over the group's
    std (0 where the group's rewards are all equal)."""
    groups: dict[int, list[float]] = {}
    for s in samples:
        groups.setdefault(s["group_index"], []).append(s["reward"])
    stats = {}
    for index, rewards in groups.items():
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / max(len(rewards) - 1, 1))
        stats[index] = mean, std
    return [
        (s["reward"] - stats[s["group_index"]][0]) / (stats[s["group_index"]][1] + 1e-6)
        for s in samples
    ]


def update_effect(after, samples: list[dict], advantages: list[float], temperature: float):
    """How the step's update moved the policy on the step's own trained tokens: the mean
    |new - old| log-prob, and the token-mean of advantage x (new - old) (the surrogate the
    update should raise)."""
    moved = gain = count = 0.0
    for s, advantage in zip(samples, advantages, strict=True):
        for new, old in trained_log_probs(after, s, temperature):
            moved, gain, count = moved + abs(new - old), gain + advantage * (new - old), count + 1
    return moved / count, gain / count


def call_log_prob(model, tokenizer, rows: list[dict]) -> float:
    """Mean log-prob (at temperature 1) of a whole well-formed calculator call after its
    prompt."""
    total = 0.0
    for row in rows:
        prompt = tokenizer.encode(row["prompt"], add_special_tokens=False)
        response = tokenizer.encode(row["response"] + "<|im_end|>", add_special_tokens=False)
        total += float(token_log_probs(model, prompt + response, 1.0)[len(prompt) - 1 :].sum())
    return total / len(rows)


class Weights:
    """The policy of each weight version: ``--start`` for 0, else the run's HF export of
    that step (None where it was not kept)."""

    def __init__(self, run_dir: Path, start: Path):
        self.run_dir, self.start, self.cache = run_dir, start, {}

    def __call__(self, version: int):
        if version not in self.cache:
            path = (
                self.start if version == 0 else self.run_dir / f"checkpoints/step_{version:06d}/hf"
            )
            self.cache[version] = (
                AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
                if path.is_dir()
                else None
            )
        return self.cache[version]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("dumps", type=Path)
    parser.add_argument("--replies", type=Path, required=True, help="the run's AGENT_LOG")
    parser.add_argument("--start", type=Path, required=True, help="the weights of version 0")
    parser.add_argument("--temperature", type=float, default=0.7, help="rollout.temperature")
    args = parser.parse_args()
    from calculator_agent import TOOLS

    tokenizer = AutoTokenizer.from_pretrained(args.start)
    replies = load_replies(args.replies)
    calls = [
        json.loads(line)
        for line in (HERE / "data" / "sft.jsonl").read_text().splitlines()
        if "<tool_call>" in json.loads(line)["response"]
    ][:40]
    weights = Weights(args.run_dir, args.start)
    print("step version ids_differ masks_differ max_lp_gap adv_abs_mean call_lp |dlp| gain")
    for path in sorted(args.dumps.glob("rollout_*.jsonl")):
        step = int(path.stem.split("_")[1])
        samples = [json.loads(line) for line in path.read_text().splitlines()]
        version = int(samples[0]["weight_versions"][0])
        ids_bad = masks_bad = 0
        for s in samples:
            response = s["tokens"][-s["response_length"] :]
            trained = [t for bit, run in mask_runs(response, s["loss_mask"]) if bit for t in run]
            engine = [t for reply in replies[s["metadata"]["rid"]] for t in reply]
            ids_bad += trained != engine
            masks_bad += not untrained_is_template(tokenizer, s, TOOLS)
        adv = grpo_advantages(samples)
        line = f"{step:4d} {version:7d} {ids_bad:10d} {masks_bad:12d}"
        model, after = weights(version), weights(step)
        if model is not None:
            pairs = [
                pair for s in samples for pair in trained_log_probs(model, s, args.temperature)
            ]
            gap = max(abs(m - e) for m, e in pairs)
            line += f" {gap:10.1e} {sum(map(abs, adv)) / len(adv):12.3f}"
            line += f" {call_log_prob(model, tokenizer, calls):7.2f}"
        if after is not None:  # how far the step's update moved the policy on its own batch
            moved, gain = update_effect(after, samples, adv, args.temperature)
            line += f" {moved:6.3f} {gain:7.4f}"
        print(line)


if __name__ == "__main__":
    main()
