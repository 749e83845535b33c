"""bench/fp8_rollout.py's CPU simulation of the gap an FP8 engine should show on its random
model: SGLang's activation rounding (one e4m3 scale per token and 128-group) and, on the
tiny shape, that the simulated FP8 engine is told apart from a bf16 one and from the FP8
round trip of the weights alone."""

import importlib.util
import math
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[3] / "bench"


def load_bench():
    sys.path.insert(0, str(BENCH))  # the bench imports its siblings (model_shapes, report)
    try:
        spec = importlib.util.spec_from_file_location("fp8_rollout", BENCH / "fp8_rollout.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_activations_are_rounded_per_token_and_group_of_128():
    bench = load_bench()
    x = torch.randn(3, 200)
    x[:, :128] *= 1e6  # the first group large, the partial second group (72 wide) small
    rounded = bench.quantize_activation_groups(x)
    assert rounded.shape == x.shape and not torch.equal(rounded, x)
    for group in (slice(0, 128), slice(128, 200)):
        amax = x[:, group].abs().amax(-1, keepdim=True)
        # e4m3 keeps 3 mantissa bits: within 1/16 of the group's own largest value; a
        # scale shared across the groups would round the small group to 0
        assert ((rounded[:, group] - x[:, group]).abs() <= amax / 16).all()
    assert torch.equal(bench.quantize_activation_groups(rounded), rounded)  # on the grid


def test_random_model_gaps_order_as_expected(monkeypatch):
    bench = load_bench()
    tied = {**bench.SHAPES["tiny"], "tie_word_embeddings": True}  # as the Qwen shapes are
    monkeypatch.setitem(bench.SHAPES, "tiny", tied)
    args = bench.argparse.Namespace(
        shape="tiny", layers=None, cpu_prompts=2, prompt_len=16, cpu_new_tokens=8
    )
    gaps = bench.run_cpu_random(args)["gap"]
    assert all(g["tokens"] == 16 and math.isfinite(g["mean"]) for g in gaps.values())
    # FP8 rounding moves log-probs by more than bf16 rounding, yet stays well below a nat
    assert gaps["bfloat16"]["mean"] < gaps["fp8_float32"]["mean"] < 0.5
    assert gaps["fp8_float32_vs_fp8_round_trip"]["mean"] > 0  # activations rounded too
