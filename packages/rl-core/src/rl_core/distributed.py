"""Joining the default process group, for every training backend (rl-fsdp, rl-megatron)
and the launcher, so none of them imports another for it.

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
