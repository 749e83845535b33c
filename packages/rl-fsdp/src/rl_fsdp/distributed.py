"""Process-group setup and the few collectives the backend needs.

``init_distributed`` works in both ways a rank is started: by torchrun-like environment
variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) or with everything given
explicitly (the Ray launcher). Without either it starts a world of one on 127.0.0.1.
"""

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rl_core.batch import TrainBatch, to_device
from rl_core.packing import balanced_partitions


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def resolve_device(device: str) -> torch.device:
    """The torch device for "auto" (cuda when available), "cpu" or "cuda" (checked)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available; use device='cpu'")
    return torch.device(device)


def init_distributed(
    *,
    device: str = "auto",
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    local_rank: int | None = None,
    timeout_s: float = 600.0,
) -> DistInfo:
    """Join (or reuse) the default process group: gloo on CPU; nccl (+ gloo for CPU
    tensors) on CUDA.

    Explicit arguments win over RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT / LOCAL_RANK.
    """
    kind = resolve_device(device).type
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        if world_size > 1 and not (master_port or os.environ.get("MASTER_PORT")):
            raise ValueError(
                "world_size > 1 needs master_port (or MASTER_PORT) shared by all ranks"
            )
        master_addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = master_port or int(os.environ.get("MASTER_PORT", 0)) or free_port(master_addr)
        _set_local_device(kind, rank, local_rank)  # before nccl creates its communicators
        dist.init_process_group(
            # On GPU, gloo too: CPU-offloaded shards (grad-norm, DCP metadata) reduce on CPU.
            backend="cpu:gloo,cuda:nccl" if kind == "cuda" else "gloo",
            init_method=f"tcp://{master_addr}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    local_rank, torch_device = _set_local_device(kind, dist.get_rank(), local_rank)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, torch_device)


def _set_local_device(kind: str, rank: int, local_rank: int | None):
    """(local_rank, device): LOCAL_RANK, else rank modulo the GPUs of this host."""
    if kind != "cuda":
        return (0 if local_rank is None else local_rank), torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return local_rank, device


def all_reduce_sum(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum scalar metrics over all ranks (one collective; keys must agree on every rank)."""
    if not values or dist.get_world_size() == 1:
        return dict(values)
    keys = sorted(values)
    stacked = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(stacked)
    return dict(zip(keys, stacked.tolist(), strict=True))


def add_metrics(sums: dict, metrics: dict) -> None:
    """``sums[key] += value`` in float64, tensors staying on their device (no read-back).
    Float64 on the device rounds exactly as Python floats do, so reading the sums back
    once gives the same floats as reading every micro-batch's value."""
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().to(torch.float64)
        sums[key] = sums.get(key, 0.0) + value


def all_reduce_metrics(
    values: dict, device: torch.device, *, unreduced: dict | None = None
) -> dict[str, float]:
    """:func:`all_reduce_sum` for floats and 0-d device tensors, read back ONCE; the
    ``unreduced`` ones (e.g. the already global grad norm) ride along unsummed."""
    keys = sorted(values)
    lazy = [k for k in keys if isinstance(values[k], torch.Tensor)]
    eager = [k for k in keys if not isinstance(values[k], torch.Tensor)]
    host = torch.tensor([float(values[k]) for k in eager], dtype=torch.float64)
    parts = [torch.stack([values[k].to(torch.float64) for k in lazy])] if lazy else []
    stacked = torch.cat([*parts, to_device(host, device)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stacked)
    extra = sorted(unreduced or {})
    if extra:
        norms = [torch.as_tensor(unreduced[k]).detach().reshape(1) for k in extra]
        stacked = torch.cat([stacked, *(n.to(stacked.device, torch.float64) for n in norms)])
    out = dict(zip(lazy + eager + extra, stacked.tolist(), strict=True))
    return {key: out[key] for key in keys + extra}


def all_reduce_max_int(value: int, device: torch.device) -> int:
    if dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def global_denominators(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """The batch with ``global_num_tokens/seqs`` summed over ranks, unless already set."""
    if batch.global_num_tokens is not None and batch.global_num_seqs is not None:
        return batch
    local = batch.with_global_denominators()
    summed = all_reduce_sum(
        {"tokens": local.global_num_tokens, "seqs": local.global_num_seqs}, device
    )
    local.global_num_tokens, local.global_num_seqs = summed["tokens"], summed["seqs"]
    return local


def shard_for_rank(batch: TrainBatch, rank: int, world_size: int) -> TrainBatch:
    """This rank's part of a global batch, sequences balanced by tokens across ranks
    (rl_core.packing.balanced_partitions); global denominators are those of ``batch``."""
    if batch.global_num_tokens is None or batch.global_num_seqs is None:
        batch = batch.with_global_denominators()
    parts = balanced_partitions(batch.seq_lengths(), world_size)
    return batch.select(parts[rank])
