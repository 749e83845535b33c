"""HostStash (rl_fsdp.offload): device storages emptied and refilled in place. On CPU the
same mechanism runs without pinning, so the FSDP2 round trip is checked here exactly; the
GPU test (test_fsdp_gpu.py) checks that device memory is freed."""

import pytest
import torch
from fsdp_tiny import CONFIGS, tokens_batch

from rl_fsdp import FSDPConfig
from rl_fsdp.offload import HostStash, optimizer_state_tensors


def test_views_share_one_buffer_and_come_back_in_place():
    base = torch.arange(12, dtype=torch.float32)
    view, other = base[4:8], torch.ones(3, dtype=torch.int64)
    stash = HostStash(pin=False)
    moved = stash.release([base, view, other])
    assert moved == 12 * 4 + 3 * 8  # the view's storage is the base's: counted once
    assert base.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    assert stash.released
    assert stash.restore() == moved and not stash.released
    assert torch.equal(base, torch.arange(12, dtype=torch.float32))
    assert torch.equal(view, torch.tensor([4.0, 5.0, 6.0, 7.0]))
    base.add_(1)  # views still alias the regrown storage
    assert torch.equal(view, torch.tensor([5.0, 6.0, 7.0, 8.0]))
    assert torch.equal(other, torch.ones(3, dtype=torch.int64))


def test_release_twice_without_restore_is_refused():
    stash = HostStash(pin=False)
    stash.release([torch.zeros(4)])
    with pytest.raises(RuntimeError, match="without restore"):
        stash.release([torch.zeros(4)])


def test_host_buffers_are_reused_across_turns():
    """A regrown storage has a new address; its host buffer must still be found (one
    pinned allocation per storage for the whole run, not one per turn)."""
    tensors, stash, blockers = [torch.randn(4096), torch.randn(8192)], HostStash(pin=False), []
    stash.release(tensors)
    buffers = list(stash._host.values())
    for round_ in range(3):
        blockers.append(torch.empty(8192 + 4096))  # takes the freed addresses
        stash.restore()
        for tensor in tensors:
            tensor.add_(1)
        expected = [tensor.clone() for tensor in tensors]
        stash.release(tensors)
        assert all(a is b for a, b in zip(stash._host.values(), buffers, strict=True)), round_
    stash.restore()
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected, strict=True))


@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist

    from rl_core.distributed import init_distributed

    yield init_distributed(device="cpu")
    dist.destroy_process_group()


def _backend(world_of_one):
    from rl_fsdp import FSDPBackend

    config = FSDPConfig(
        model_config=CONFIGS["qwen2"], lr=1e-2, max_tokens_per_micro_batch=48, fsdp_on_one_rank=True
    )
    torch.manual_seed(0)
    return FSDPBackend(config, dist_info=world_of_one)


def _rl_batch():
    batch = tokens_batch()
    batch.advantages = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(3))
    return batch.with_global_denominators()


def test_fsdp_state_round_trip_leaves_training_unchanged(world_of_one):
    """Two steps with the whole training state (DTensor shards, AdamW moments) released and
    restored between them equal two steps without: bit for bit."""
    plain, stashed, batch = _backend(world_of_one), _backend(world_of_one), _rl_batch()
    expected = [plain.train_step(batch)["loss/total"] for _ in range(2)]
    first = stashed.train_step(batch)["loss/total"]
    tensors = [*stashed.model.parameters(), *optimizer_state_tensors(stashed.optimizer)]
    stash = HostStash(pin=False)
    moved = stash.release(tensors)
    params = sum(p.to_local().numel() * 4 for p in stashed.model.parameters())
    assert moved >= 3 * params  # weights + two AdamW moments (+ step counters)
    assert all(p.to_local().untyped_storage().nbytes() == 0 for p in stashed.model.parameters())
    stash.restore()
    assert [first, stashed.train_step(batch)["loss/total"]] == expected
    for (name, got), want in zip(
        stashed.model.state_dict().items(), plain.model.state_dict().values(), strict=True
    ):
        assert torch.equal(got.full_tensor(), want.full_tensor()), name


def test_one_rank_exports_its_parameters_without_gathering(world_of_one):
    """On one rank a parameter's local shard is the whole tensor: the export hands it out
    as is (no all-gather, no copy) and equals the gathered value."""
    backend = _backend(world_of_one)
    params = dict(backend.model.named_parameters())
    exported = [item for bucket in backend.export_weights(bucket_bytes=1 << 30) for item in bucket]
    assert [name for name, _ in exported] == list(params)
    for name, tensor in exported:
        assert torch.equal(tensor, params[name].full_tensor())
        assert tensor.data_ptr() == params[name].to_local().data_ptr()  # not a copy
