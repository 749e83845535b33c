"""Device memory handed back and restored in place, through pinned host buffers.

Colocated with engines, the trainer leaves the GPU after every step and comes back before
the next one. Moving its state with ``module.to("cpu")`` copies into pageable host memory
(one synchronous copy per tensor, ~6 GB/s) and builds new tensors that the optimizer state
must be re-pointed at. :class:`HostStash` instead copies each storage once into a pinned
host buffer kept for the run, then shrinks the device storage to zero bytes (what FSDP2
itself does with unsharded parameters). Every tensor object, view, DTensor and optimizer
state entry stays the same object; :meth:`HostStash.restore` regrows the storages and
copies the bytes back. Both directions are asynchronous copies from or into pinned memory,
ended by one synchronisation.

Between :meth:`HostStash.release` and :meth:`HostStash.restore` the tensors must not be
read: their storages hold no bytes.
"""

from collections.abc import Iterable

import torch


class HostStash:
    """Pinned host copies of the storages behind ``tensors`` (one per distinct storage)."""

    def __init__(self, *, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._host: dict[int, torch.Tensor] = {}  # storage position -> uint8 host buffer
        self._released: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def released(self) -> bool:
        return bool(self._released)

    def release(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy the storages of ``tensors`` to host and free them; returns the bytes moved."""
        if self._released:
            raise RuntimeError("HostStash.release called twice without restore")
        storages = _distinct_storages(tensors)
        # buffers are matched by position: a regrown storage has a new address
        for key, storage in enumerate(storages.values()):
            host = self._host_buffer(key, storage.nbytes())
            host.copy_(_bytes_of(storage), non_blocking=self.pin)
            self._released.append((storage, host))
        _wait(storages.values())
        for storage, _ in self._released:
            storage.resize_(0)
        return sum(host.numel() for _, host in self._released)

    def restore(self) -> int:
        """Regrow every released storage and copy its bytes back; returns the bytes moved."""
        moved = 0
        for storage, host in self._released:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=self.pin)
            moved += host.numel()
        _wait(storage for storage, _ in self._released)
        self._released = []
        return moved

    def _host_buffer(self, key: int, nbytes: int) -> torch.Tensor:
        host = self._host.get(key)
        if host is None or host.numel() != nbytes:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self._host[key] = host
        return host


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """Storages by identity of their first byte (views of one storage count once); DTensors
    by their local shard; empty storages are skipped."""
    out: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        if storage.nbytes() > 0:
            out.setdefault(storage.data_ptr(), storage)
    return out


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _wait(storages: Iterable[torch.UntypedStorage]) -> None:
    if any(storage.device.type == "cuda" for storage in storages):
        torch.cuda.synchronize()


def training_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
    """Parameters and optimizer state tensors (step counters included: a fused AdamW keeps
    them on the device). Gradients are not state: drop them before releasing."""
    yield from model.parameters()
    for state in optimizer.state.values() if optimizer is not None else ():
        yield from (value for value in state.values() if isinstance(value, torch.Tensor))
