"""HostStash (rl_fsdp.offload): device storages emptied and refilled in place. On CPU the
same mechanism runs without pinning, so the FSDP2 round trip is checked here exactly; the
GPU test (test_fsdp_gpu.py) checks that device memory is freed."""

import pytest
import torch
from fsdp_tiny import CONFIGS, tokens_batch

from rl_fsdp import FSDPConfig
from rl_fsdp.offload import HostStash, storage_keys, training_tensors


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
    tensors = list(training_tensors(stashed.model, stashed.optimizer))
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


def test_queued_release_keeps_the_bytes_until_settled():
    """release(wait=False): the storages keep their bytes until settle() (on CUDA the copies
    are still in flight); a restore right after settles first, and restore(wait=False)
    gives the same bytes back (ready() then has nothing to wait for on CPU)."""
    base, other = torch.arange(12, dtype=torch.float32), torch.ones(3, dtype=torch.int64)
    stash = HostStash(pin=False)
    assert stash.release([base, other], wait=False) == 12 * 4 + 3 * 8
    assert not stash.settled and base.untyped_storage().nbytes() == 12 * 4
    stash.settle()
    assert stash.settled and base.untyped_storage().nbytes() == 0
    stash.settle()  # idempotent
    assert stash.restore(wait=False) == 12 * 4 + 3 * 8
    stash.ready()
    assert torch.equal(base, torch.arange(12, dtype=torch.float32))
    stash.release([base, other], wait=False)
    assert stash.restore() == 12 * 4 + 3 * 8 and stash.settled  # settled, then refilled
    assert torch.equal(base, torch.arange(12, dtype=torch.float32))
    assert torch.equal(other, torch.ones(3, dtype=torch.int64))
    assert stash.restore() == 0  # nothing released


LAYOUTS = {
    "master_bf16": {"fsdp_on_one_rank": False, "precision": "bf16"},
    "fsdp": {"fsdp_on_one_rank": True},
}


@pytest.mark.parametrize("background", [True, False], ids=["two_phase", "whole"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trainer_turns_leave_training_unchanged(world_of_one, layout, background):
    """The trainer's offload/onload bodies (``_move_out`` / ``_move_in``; on CPU the copies
    are synchronous, the GPU test runs them on streams): two steps with a turn between
    them equal two steps without, parameters and optimizer state bit for bit. Two-phase:
    what a forward needs (the compute copy without FSDP, the parameters with it) is one
    stash, the optimizer state and float32 masters the other, no storage in both."""
    from rl_fsdp import FSDPBackend

    config = FSDPConfig(
        model_config=CONFIGS["qwen2"], lr=1e-2, max_tokens_per_micro_batch=48, **LAYOUTS[layout]
    )
    backends = []
    for _ in range(2):
        torch.manual_seed(0)
        backends.append(FSDPBackend(config, dist_info=world_of_one))
    plain, turned = backends
    assert (plain.master is not None) == (layout == "master_bf16")
    batch = _rl_batch()
    expected = [plain.train_step(batch)["loss/total"] for _ in range(2)]
    first = turned.train_step(batch)["loss/total"]
    forward, state = turned._offloaded_tensors(split=background)
    everything = storage_keys(training_tensors(turned.model, turned.optimizer))
    if background:
        computes = turned.master.compute if turned.master else None
        wanted = [computes] if computes is not None else list(turned.model.parameters())
        assert storage_keys(forward) == storage_keys(wanted)
        assert storage_keys(state) == everything - storage_keys(forward)
    else:
        assert forward == [] and storage_keys(state) == everything
    turned._move_out(background=background)
    assert turned._state_stash.settled != background  # queued: freed by the next onload
    turned._state_stash.settle()
    turned._stash.settle()
    assert all(_local_bytes(t) == 0 for t in turned.model.parameters())
    if turned.master is not None:  # freed or stashed, nothing kept on the device
        assert all(t.untyped_storage().nbytes() == 0 for t in turned.master.scratch())
    turned._move_in(background=background)
    turned.state_ready()
    assert [first, turned.train_step(batch)["loss/total"]] == expected
    for (name, got), want in zip(
        turned.model.state_dict().items(), plain.model.state_dict().values(), strict=True
    ):
        assert torch.equal(_full(got), _full(want)), name
    moments = [
        (_full(a), _full(b))
        for sa, sb in zip(
            turned.optimizer.state.values(), plain.optimizer.state.values(), strict=True
        )
        for a, b in zip(sa.values(), sb.values(), strict=True)
        if isinstance(a, torch.Tensor)
    ]
    assert moments and all(torch.equal(a, b) for a, b in moments)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().nbytes()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
