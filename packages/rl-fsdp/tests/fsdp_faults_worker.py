"""What the processes of test_fsdp_faults.py run.

``run``: 2 spawned gloo ranks take one good step, two poisoned ones (NaN advantages on
rank 1 only, then +inf on rank 0 only) and another good one, beside a reference backend
that only takes the two good steps; then they load what survived of the killed saves.
``python fsdp_faults_worker.py WORKDIR POINT``: a world of one that saves a checkpoint,
then overwrites it and blocks at POINT inside the save (the test SIGKILLs it there).
"""

import dataclasses
import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_tiny import CONFIGS, tokens_batch

from rl_core.distributed import init_distributed
from rl_fsdp import FSDPBackend, FSDPConfig, shard_for_rank
from rl_fsdp import checkpoint as fsdp_checkpoint
from rl_fsdp.weights import full_tensor

ACTOR = {
    "model_config": CONFIGS["qwen2"],
    "device": "cpu",
    "lr": 1e-2,
    "warmup_steps": 2,
    "lr_decay": "cosine",
    "total_steps": 6,
}


def rl_batch():
    batch = tokens_batch()
    gen = torch.Generator().manual_seed(3)
    batch.advantages = torch.randn(batch.num_tokens, generator=gen)
    return batch.with_global_denominators()


def snapshot(backend) -> dict:
    """This rank's parameter shards, AdamW state, schedule and step, copied."""
    names = {p: n for n, p in backend.model.named_parameters()}
    return {
        "params": {n: _local(p) for n, p in backend.model.named_parameters()},
        "optim": {
            names[p]: {k: _local(v) for k, v in state.items()}
            for p, state in backend.optimizer.state.items()
        },
        "scheduler": backend.scheduler.state_dict(),
        "step": backend.step,
    }


def _local(tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).clone()


def bit_identical(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(bit_identical(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(bit_identical(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def poisoned(local, rank: int, bad_rank: int, value: float):
    """``local`` with one loss-masked advantage set to ``value`` on ``bad_rank`` only."""
    advantages = local.advantages.clone()
    if rank == bad_rank:
        advantages[int(local.loss_mask.nonzero()[0])] = value
    return dataclasses.replace(local, advantages=advantages)


def run(rank: int, world_size: int, port: int, workdir: str, killed: list[str]) -> None:
    """The non-finite checks, then :func:`load_what_survived` in each ``killed`` dir."""
    faulthandler.enable()  # a native abort prints every thread's Python stack
    dist_info = init_distributed(
        device="cpu", rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port
    )
    try:
        result = _nonfinite_checks(dist_info)
        load_what_survived([Path(d) for d in killed], dist_info, write=rank == 0)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, result)
        if rank == 0:
            torch.save(gathered, Path(workdir) / "nonfinite.pt")
    finally:
        dist.destroy_process_group()


def _nonfinite_checks(dist_info) -> dict:
    rank = dist_info.rank
    local = shard_for_rank(rl_batch(), rank, dist_info.world_size)
    backend = FSDPBackend(FSDPConfig(**ACTOR), dist_info=dist_info)
    reference = FSDPBackend(FSDPConfig(**ACTOR), dist_info=dist_info)
    good = [backend.train_step(local)]
    before = snapshot(backend)
    bad = [
        backend.train_step(poisoned(local, rank, bad_rank=1, value=float("nan"))),
        backend.train_step(poisoned(local, rank, bad_rank=0, value=float("inf"))),
    ]
    after_bad = snapshot(backend)
    grads_dropped = all(p.grad is None for p in backend.model.parameters())
    good.append(backend.train_step(local))
    expected = [reference.train_step(local) for _ in range(2)]
    return {
        "bad": bad,
        "good": good,
        "expected": expected,
        "untouched": bit_identical(before, after_bad),
        "grads_dropped": grads_dropped,
        "moved_by_good_step": not bit_identical(after_bad["params"], snapshot(backend)["params"]),
        "same_as_reference": bit_identical(snapshot(backend), snapshot(reference)),
    }


# --- SIGKILL during a checkpoint save (a world of one, run as a script) -----------------
def _block(workdir: Path) -> None:
    (workdir / "blocked").write_text(str(os.getpid()))
    time.sleep(3600)  # the test SIGKILLs this process here


def _block_at(point: str, workdir: Path) -> None:
    """Make the next save stop at ``point``: "writing" (shards on disk, no completeness
    mark yet) or "swapping" (the previous checkpoint moved aside, the new one not in place)."""
    if point == "writing":
        rng_state = fsdp_checkpoint.rng_state
        fsdp_checkpoint.rng_state = lambda: (_block(workdir), rng_state())[1]
        return
    replace = os.replace

    def blocking_replace(src, dst):
        if str(src).endswith(".tmp"):
            _block(workdir)
        return replace(src, dst)

    os.replace = blocking_replace


def _full_weights(backend) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.detach()).clone() for n, p in backend.model.named_parameters()}


def save_then_block(workdir: Path, point: str) -> None:
    backend = FSDPBackend(FSDPConfig(**ACTOR), dist_info=init_distributed(device="cpu"))
    batch = rl_batch()
    backend.train_step(batch)
    backend.save_checkpoint(workdir / "ckpt")
    torch.save(_full_weights(backend), workdir / "expected.pt")
    backend.train_step(batch)
    _block_at(point, workdir)
    backend.save_checkpoint(workdir / "ckpt")


def load_what_survived(workdirs: list[Path], dist_info, *, write: bool) -> None:
    """In each directory: restore ``ckpt`` (saved by a world of one) in a fresh backend and
    compare with the weights its first, complete save held; results in ``loaded.json``."""
    backend = FSDPBackend(FSDPConfig(**ACTOR), dist_info=dist_info)
    for workdir in workdirs:
        backend.load_checkpoint(workdir / "ckpt")
        expected = torch.load(workdir / "expected.pt", weights_only=True)
        same = bit_identical(_full_weights(backend), expected)
        if write:
            (workdir / "loaded.json").write_text(json.dumps({"step": backend.step, "same": same}))


if __name__ == "__main__":
    save_then_block(Path(sys.argv[1]), sys.argv[2])
