"""Micro-batches built on the host and moved to the device in one copy.

The step's batch arrives on the host (from the launcher). Everything a micro-batch's
forward needs that depends on sequence boundaries (cu_seqlens, position ids) is computed
here from HOST tensors, packed with the micro-batch's tensors into one byte buffer, pinned
(CUDA only) and copied with ``non_blocking=True``: the host never waits for the GPU to drain, and no boundary is ever
read back from the device.

Shapes: N tokens, B sequences; ``position_ids`` ``[N]`` int64; ``host_cu_seqlens``
``[B + 1]`` int32.
"""

from dataclasses import dataclass, fields

import torch

from rl_core.batch import TrainBatch
from rl_core.packing import position_ids_from_cu_seqlens


@dataclass(kw_only=True)
class DeviceMicroBatch(TrainBatch):
    """A :class:`TrainBatch` on the compute device that keeps its boundaries on the host
    (``host_cu_seqlens``) and the forward's inputs built from them on the device."""

    host_cu_seqlens: torch.Tensor
    position_ids: torch.Tensor

    def __post_init__(self):
        """TrainBatch's checks, against the host boundaries (no device read-back)."""
        self._check_fields(int(self.host_cu_seqlens[-1]))


def to_device(mb: TrainBatch, device: torch.device) -> DeviceMicroBatch:
    """``mb`` (on the host) as a :class:`DeviceMicroBatch` on ``device``: one copy."""
    host_cu = mb.cu_seqlens
    if host_cu.device.type != "cpu":
        raise ValueError("to_device takes a host micro-batch; call batch.to('cpu') once first")
    tensors = {f.name: getattr(mb, f.name) for f in fields(TrainBatch)}
    tensors = {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    tensors["position_ids"] = position_ids_from_cu_seqlens(host_cu)
    moved = copy_to_device(tensors, device)
    others = {f.name: getattr(mb, f.name) for f in fields(TrainBatch) if f.name not in moved}
    return DeviceMicroBatch(host_cu_seqlens=host_cu, **others, **moved)


def copy_to_device(tensors: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """Host tensors on ``device`` through ONE pinned, non-blocking copy (none on CPU)."""
    device = torch.device(device)
    if device.type == "cpu":
        return dict(tensors)
    buffer, specs = pack(tensors, pin=device.type == "cuda")
    return unpack(buffer.to(device, non_blocking=True), specs)


def pack(tensors: dict[str, torch.Tensor], *, pin: bool = False):
    """One uint8 buffer holding every tensor's bytes, and the specs to cut it back up.

    Widest dtypes first, so every slice starts at a multiple of its element size."""
    order = sorted(tensors, key=lambda name: -tensors[name].element_size())
    pieces = [tensors[name].contiguous().reshape(-1).view(torch.uint8) for name in order]
    total = sum(p.numel() for p in pieces)
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    torch.cat(pieces, out=buffer)
    specs = [(name, tensors[name].dtype, tuple(tensors[name].shape)) for name in order]
    return buffer, specs


def unpack(buffer: torch.Tensor, specs) -> dict[str, torch.Tensor]:
    """Views of ``buffer`` (wherever it lives) with the names, dtypes and shapes of ``specs``."""
    out, offset = {}, 0
    for name, dtype, shape in specs:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        out[name] = buffer[offset : offset + nbytes].view(dtype).view(shape)
        offset += nbytes
    return out
