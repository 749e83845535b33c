"""The static runner's own prefill against an unbatched HF forward: last-position logits and
every layer's keys/values in the right slots, for prompts of mixed lengths; and the
compile default (on with CUDA only)."""

import pytest
import torch

from rl_sglang.engine.prefill import plan_groups
from rl_sglang.engine.static import StaticRunner, upcast_greedy_pick


def test_plan_groups_by_hand():
    # longest first; equal lengths keep their order; under half the longest: a new group
    assert plan_groups([5, 5, 2, 9]) == [[3, 0, 1], [2]]
    assert plan_groups([4, 4, 4]) == [[0, 1, 2]]
    assert plan_groups([8, 3, 4]) == [[0, 2], [1]]
    # 3 rows of 6 tokens = 18 padded tokens > 12: the third starts a new group
    assert plan_groups([6, 6, 6], max_tokens=12) == [[0, 1], [2]]
    assert plan_groups([100], max_tokens=12) == [[0]]  # one row always fits


def hf_prefill(model, prompt):
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    return out.logits[0, -1], out.past_key_values


def test_prefill_writes_each_prompts_cache_into_its_slot(tiny_model):
    runner = StaticRunner(tiny_model, max_slots=8, max_len=64)
    first = [[7, 8, 9, 10]]
    prompts = [[1, 2, 3], [9] * 11, [5], [7, 8], [100, 101, 102, 103, 104], [42] * 30]
    runner.merge(None, runner.prefill(first)[1])  # slot 0 taken: the batch starts at slot 1
    logits_BV, _ = runner.prefill(prompts)
    assert logits_BV.shape == (len(prompts), tiny_model.config.vocab_size)
    assert runner.lengths[: 1 + len(prompts)].tolist() == [4, 3, 11, 1, 2, 5, 30]
    for slot, prompt in enumerate(first + prompts):
        logits_V, cache = hf_prefill(tiny_model, prompt)
        if slot > 0:
            assert torch.allclose(logits_BV[slot - 1], logits_V, atol=1e-4)
        for layer, entry in enumerate(cache.layers):
            length = len(prompt)
            assert torch.allclose(runner.keys[layer][slot, :, :length], entry.keys[0], atol=1e-5)
            assert torch.allclose(
                runner.values[layer][slot, :, :length], entry.values[0], atol=1e-5
            )


def test_upcast_greedy_pick_by_hand():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 3.0, 0.0]], dtype=torch.bfloat16)
    tokens, logprobs = upcast_greedy_pick(logits)
    assert tokens.tolist() == [1, 0]  # a tie goes to the first index
    assert logprobs.dtype == torch.float32
    expected = [
        2 - torch.tensor([0.0, 2, 1]).logsumexp(0),
        3 - torch.tensor([3.0, 3, 0]).logsumexp(0),
    ]
    assert logprobs.tolist() == pytest.approx([float(e) for e in expected], abs=1e-6)


def test_compile_is_on_by_default_with_cuda_only(tiny_model):
    from rl_sglang.embedded import parse_args
    from rl_sglang.engine.core import Engine

    engine = Engine(tiny_model, None, max_batch_size=2, runner="static", max_context=64)
    try:
        assert engine.compile is False and not engine.scheduler.runner.compiled  # CPU
    finally:
        engine.scheduler.stop()
    assert parse_args(["--model-path", "m"]).compile is None  # the engine decides
    assert parse_args(["--model-path", "m", "--no-compile"]).compile is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_equals_the_models_module_bit_for_bit(tiny_model, dtype):
    from rl_sglang.engine.layers import signed_sin
    from rl_sglang.engine.static import rotary_table

    rotary = tiny_model.model.rotary_emb
    cos_table, sin_table = rotary_table(rotary, 100, torch.zeros(1, dtype=dtype))
    positions = torch.tensor([0, 5, 99, 37])
    cos, sin = rotary(torch.zeros(4, 1, 8, dtype=dtype), positions[:, None])
    assert cos_table.shape == (100, cos.shape[-1]) and cos_table.dtype == dtype
    assert torch.equal(cos_table[positions][:, None], cos)
    assert torch.equal(sin_table[positions][:, None], signed_sin(sin))
