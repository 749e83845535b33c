"""Activation recompute (megatron's ``recompute_granularity``: full, uniform or block, and
selective core attention) changes memory, never the numbers: the same loss and gradients
as without it, on one rank and at TP=2 (+SP) over two gloo ranks."""

import pytest
import tiny
import torch
from dist_job import LENGTHS, POLICY
from multi_rank import spawn_gloo

RECOMPUTE = {
    "none": {},
    "full-uniform": {
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "full-block": {"recompute_granularity": "full", "recompute_method": "block"}
    | {"recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective"},  # core attention
}


def loss_and_grads(hf_path, **layout) -> dict[str, dict]:
    """``{variant: {"metrics", "grads"}}`` of one forward/backward per recompute variant."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    results = {}
    batch = tiny.random_batch(LENGTHS, seed=11)
    for name, options in RECOMPUTE.items():
        config = MegatronConfig(hf_path=hf_path, megatron=options, **POLICY, **layout)
        backend = MegatronBackend(config)
        assert backend.model.config.recompute_granularity == options.get("recompute_granularity")
        calls = []  # core-attention forwards: twice per micro-batch when recomputed
        attention = backend.model.decoder.layers[0].self_attention.core_attention
        attention.register_forward_hook(lambda *args, calls=calls: calls.append(1))
        metrics = backend.forward_backward(batch)
        results[name] = {"metrics": metrics, "grads": backend.hf_gradients(), "calls": len(calls)}
    return results


def assert_same(results: dict[str, dict]) -> None:
    expected = results["none"]
    for name, got in results.items():
        assert got["calls"] == expected["calls"] * (1 if name == "none" else 2), name
        for key in ("loss/total", "loss/pg", "actor/entropy"):
            assert got["metrics"][key] == pytest.approx(expected["metrics"][key], abs=1e-6), name
        for hf_name, grad in expected["grads"].items():
            torch.testing.assert_close(got["grads"][hf_name], grad, atol=1e-6, rtol=1e-5)


def test_recompute_keeps_loss_and_grads_on_one_rank(world1, model_dirs):
    assert_same(loss_and_grads(model_dirs["qwen3"][0]))


def tp2_loss_and_grads(rank: int, hf_path: str) -> dict[str, dict]:
    return loss_and_grads(hf_path, tp=2, sequence_parallel=True)


@pytest.mark.integration
def test_recompute_keeps_loss_and_grads_at_tp2(model_dirs, tmp_path):
    hf_path = str(model_dirs["qwen3"][0])
    assert_same(spawn_gloo(tp2_loss_and_grads, 2, tmp_path / "results.pt", hf_path))
