"""The static runner's decode attention kernels (rl_sglang.engine.decode_attention).

On the CPU they run in Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the
setting is read when the kernels are defined): float32 against SDPA with a length mask,
and the runner's greedy decoding with them against the same runner with SDPA. bf16 and
the compiled, graph-captured step run on a GPU (test_decode_attention_gpu below)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl_sglang.engine.static import StaticRunner

WORKER = Path(__file__).with_name("decode_attention_worker.py")


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, str(WORKER)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernels_match_sdpa_with_a_length_mask(interpreted):
    errors = interpreted["kernel_errors"]
    assert len(errors) == 5 and all(0 <= e < 1e-5 for e in errors), errors


def test_runner_decodes_with_them_as_with_sdpa(interpreted):
    assert interpreted["fused"] == [True, False]  # "triton" and "sdpa" took their paths
    assert interpreted["same_tokens"]
    assert interpreted["logits_error"] < 1e-4


def test_unknown_choice_is_refused(tiny_model):
    with pytest.raises(ValueError, match="not one of auto, triton, sdpa"):
        StaticRunner(tiny_model, max_slots=2, max_len=32, attention="flash")
    runner = StaticRunner(tiny_model, max_slots=2, max_len=32)  # auto: SDPA on the CPU
    assert runner.fused_attention is False


@pytest.mark.gpu
def test_decode_attention_gpu():
    """bf16 on CUDA against SDPA with the mask, then an engine's greedy outputs with the
    compiled, graph-captured step under both attentions."""
    from rl_sglang.engine.decode_attention import decode_attention
    from rl_sglang.engine.layers import attend

    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows, heads, kv_heads, cache_rows, lengths in [
        (3, 14, 2, 272, [1, 200, 272]),
        (64, 9, 3, 4096, [4096] + [1 + 61 * i for i in range(63)]),
    ]:
        shape = (rows + 1, kv_heads, cache_rows, 64)
        keys, values = (torch.randn(shape, device="cuda", generator=gen) for _ in range(2))
        q = torch.randn(rows, heads, 64, device="cuda", generator=gen)
        positions = torch.tensor(lengths, device="cuda") - 1
        hidden = torch.arange(cache_rows, device="cuda")[None] > positions[:, None]
        mask = torch.where(hidden, float("-inf"), 0.0)[:, None, None]
        want = attend(q, keys[:rows], values[:rows], mask)
        got = decode_attention(q.bfloat16(), keys.bfloat16(), values.bfloat16(), positions)
        assert got.dtype == torch.bfloat16
        assert (got.float() - want).abs().max() < 3e-2
    _engines_agree()


def _engines_agree():
    import asyncio

    from rl_sglang.engine.core import Engine
    from rl_sglang.tiny import random_model, tiny_config

    model = random_model(tiny_config(num_hidden_layers=4), seed=1).cuda()
    prompts = [[3 + i] * (5 + 9 * i) for i in range(6)]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 40, "temperature": 0}}
    outputs = {}
    for attention in ("triton", "sdpa"):
        engine = Engine(model, None, max_batch_size=8, max_context=128, decode_attention=attention)

        async def go(engine=engine):
            groups, _ = engine.make_requests(body)
            return await engine.run([r for group in groups for r in group])

        outputs[attention] = [o["output_ids"] for o in asyncio.run(go())]
        runner = engine.scheduler.runner
        assert runner.fused_attention is (attention == "triton")
        assert runner.compiled  # not the eager step a failed compile falls back to
        engine.scheduler.stop()
    assert outputs["triton"] == outputs["sdpa"]  # float32: the same greedy tokens
