"""The embedded engine's device memory on the CPU: the slots that fit a memory share, and
address-stable memory (rl_sglang.engine.stable_memory).

CUDA virtual memory cannot be mapped here, so a host region stands in for it: it speaks
the same protocol (``bytes``, ``map``, ``unmap``, ``mapped``) and, like unmapped device
memory, loses its contents on ``unmap`` (it is filled with NaN bytes). The real region is
exercised by the GPU test in test_gpu_sglang.py."""

import pytest
import torch

from rl_sglang.engine import stable_memory
from rl_sglang.engine.stable_memory import ALIGN, StableMemory
from rl_sglang.engine.static import ACTIVATION_RESERVE, StaticRunner, slots_that_fit


class HostRegion:
    def __init__(self, nbytes: int, device=None):
        self.bytes = torch.zeros(nbytes, dtype=torch.uint8)
        self.mapped, self.maps, self.refusals = True, 0, 0

    def unmap(self) -> None:
        self.bytes.fill_(0xFF)  # the contents are gone (0xFFFF... is NaN in every float)
        self.mapped = False

    def map(self) -> None:
        if self.refusals:  # the device is full: the range stays unmapped, as cuMemCreate's
            self.refusals -= 1
            raise stable_memory.DriverError("cuMemCreate failed with CUDA error 2: out of memory")
        self.mapped, self.maps = True, self.maps + 1


def test_kept_tensors_come_back_and_the_rest_comes_back_zeroed():
    memory = StableMemory(HostRegion(4 * ALIGN))
    weight = memory.adopt(torch.arange(6, dtype=torch.float32).view(2, 3))
    memory.keep_contents()
    cache = memory.take((5,), torch.bfloat16).fill_(7)
    assert memory.used == 2 * ALIGN  # each tensor starts on an aligned byte
    memory.release()
    assert memory.released and torch.isnan(weight).all()
    memory.release()  # twice is once
    memory.restore()
    assert not memory.released and memory.region.maps == 1
    assert torch.equal(weight, torch.arange(6, dtype=torch.float32).view(2, 3))
    assert torch.equal(cache, torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="stable memory exhausted: 4096 bytes asked, 1024 left"):
        memory.take((1024,), torch.float32)


def test_dropped_contents_come_back_zeroed_without_a_host_copy():
    memory = StableMemory(HostRegion(4 * ALIGN))
    weight = memory.adopt(torch.arange(6, dtype=torch.float32).view(2, 3))
    memory.keep_contents()
    cache = memory.take((5,), torch.bfloat16).fill_(7)
    memory.release(keep=False)
    assert memory.released and memory.host is None  # nothing was copied out
    memory.restore()
    assert not weight.any() and not cache.any()
    memory.release()  # a later release keeps them again
    memory.restore()
    assert not weight.any() and memory.host is not None


def test_a_refused_restore_leaves_the_memory_released_for_another_try():
    memory = StableMemory(HostRegion(2 * ALIGN))
    weight = memory.adopt(torch.full((4,), 3.0))
    memory.keep_contents()
    memory.release()
    memory.region.refusals = 1
    with pytest.raises(stable_memory.DriverError, match="out of memory"):
        memory.restore()
    assert memory.released
    memory.restore()
    assert not memory.released and torch.equal(weight, torch.full((4,), 3.0))


def test_size_of_counts_alignment():
    specs = [((3,), torch.float32), ((2, 2), torch.bfloat16), ((ALIGN,), torch.uint8)]
    assert StableMemory.size_of(specs) == 3 * ALIGN


def test_no_stable_memory_off_cuda():
    assert StableMemory.for_bytes(1 << 20, torch.device("cpu")) is None


def _greedy(runner, prompts, steps=6):
    logits_BV, state = runner.prefill(prompts)
    state = runner.merge(None, state)
    tokens, out = logits_BV.argmax(dim=-1), []
    for _ in range(steps):
        tokens, _ = runner.decode(state, tokens, greedy=True)
        out.append(tokens.clone())
    runner.select(state, [])
    return torch.stack(out)


def test_static_runner_keeps_its_tensors_across_a_release(tiny_dir, monkeypatch):
    from rl_sglang.engine.core import load_model

    monkeypatch.setattr(
        StableMemory, "for_bytes", classmethod(lambda cls, n, device: cls(HostRegion(n)))
    )
    model, _ = load_model(str(tiny_dir), device="cpu", dtype="float32")
    expected = _greedy(StaticRunner(model, max_slots=4, max_len=64), [[1, 2, 3], [9] * 11])
    runner = StaticRunner(model, max_slots=4, max_len=64, stable_memory=True)
    memory = runner.stable
    addresses = [p.data_ptr() for p in model.parameters()]
    region = memory.region.bytes
    inside = [region.data_ptr() <= a < region.data_ptr() + region.numel() for a in addresses]
    assert all(inside) and memory.kept_bytes < memory.used <= memory.nbytes
    tensors = [runner.keys[0], runner.values[-1], runner.layers[0].qkv[0]]
    assert torch.equal(_greedy(runner, [[1, 2, 3], [9] * 11]), expected)
    runner.release()
    assert memory.released and torch.isnan(next(model.parameters())).all()
    runner.resume()
    assert [p.data_ptr() for p in model.parameters()] == addresses
    assert [runner.keys[0], runner.values[-1], runner.layers[0].qkv[0]] == tensors
    assert all(t.abs().sum() == 0 for t in runner.keys + runner.values)  # zeroed, not NaN
    assert torch.equal(_greedy(runner, [[1, 2, 3], [9] * 11]), expected)
    saved = [p.detach().clone() for p in model.parameters()]
    runner.release(keep_weights=False)  # dropped: back zeroed, refilled by the caller
    runner.resume()
    assert [p.data_ptr() for p in model.parameters()] == addresses
    assert all(not p.any() for p in model.parameters())
    with torch.no_grad():
        for param, value in zip(model.parameters(), saved, strict=True):
            param.copy_(value)
    assert torch.equal(_greedy(runner, [[1, 2, 3], [9] * 11]), expected)
    assert stable_memory.VirtualRegion  # the real region the stand-in replaces


def test_slots_that_fit_count_each_slots_caches_and_logits(tiny_model):
    config = tiny_model.config  # float32, 2 layers, 2 KV heads of 16, vocab 320
    head_dim = config.hidden_size // config.num_attention_heads
    kv_per_slot = 2 * 2 * config.num_key_value_heads * 64 * head_dim * 4  # 64 rows (60 -> 64)
    per_slot = kv_per_slot + 2 * config.vocab_size * (4 + 4)
    budget = ACTIVATION_RESERVE + 10 * per_slot + per_slot // 2
    assert slots_that_fit(tiny_model, 60, budget) == 10
    assert slots_that_fit(tiny_model, 60, ACTIVATION_RESERVE - 1) == 0


def test_a_memory_share_is_checked_and_bounds_only_device_engines(tiny_dir):
    from rl_sglang.engine.core import Engine, load_model

    model, tokenizer = load_model(str(tiny_dir))
    with pytest.raises(ValueError, match=r"mem_fraction must be in \(0, 1\], got 1.5"):
        Engine(model, tokenizer, runner="static", max_context=64, mem_fraction=1.5)
    engine = Engine(
        model, tokenizer, runner="static", max_context=64, max_batch_size=8, mem_fraction=0.01
    )
    try:  # on the CPU the share does not apply: the batch stays as asked
        assert engine.scheduler.max_batch_size == 8
    finally:
        engine.scheduler.stop()
