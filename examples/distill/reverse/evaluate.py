"""How well an HF checkpoint reverses: per model directory, over the 1000 prompts,

- p_exact: the mean probability that one sample at temperature 1 is exactly the answer
  (the product of the teacher-forced probabilities of its three digits), i.e. the expected
  exact-match reward of a rollout;
- greedy: the fraction answered right by greedy decoding;
- digit_p: the mean probability of each answer digit (first, second, third).

    uv run --package rl-launcher python examples/distill/reverse/evaluate.py DIR [DIR ...]
"""

import sys

import torch
from build_data import rows  # the same 1000 (prompt, answer) pairs
from transformers import AutoModelForCausalLM, AutoTokenizer

TOKENIZER = "examples/quickstart/tokenizer"


def answer_log_probs(model, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, 3]`` teacher-forced log-probs of the answer digits, and ``[N, 3]`` whether
    each digit is the argmax (greedy decoding is right when all three are)."""
    pairs = rows()
    ids = torch.tensor([tokenizer.encode(p + a) for p, a in pairs])  # 7 tokens each
    with torch.no_grad():
        logits = model(ids).logits.float()
    predicted = logits[:, 3:6].log_softmax(-1)  # positions of '=', d1, d2 predict d1..d3
    targets = ids[:, 4:7]
    return predicted.gather(-1, targets[..., None])[..., 0], predicted.argmax(-1) == targets


def report(path: str) -> dict[str, float | list[float]]:
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    log_probs, argmax_right = answer_log_probs(model, tokenizer)
    return {
        "p_exact": float(log_probs.sum(-1).exp().mean()),
        "greedy": float(argmax_right.all(-1).float().mean()),
        "digit_p": [round(float(p), 3) for p in log_probs.exp().mean(0)],
    }


if __name__ == "__main__":
    for directory in sys.argv[1:]:
        print(directory, report(directory))
