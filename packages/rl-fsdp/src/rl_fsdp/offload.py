"""Device memory handed back and restored in place, through pinned host buffers.

Colocated with engines, the trainer leaves the GPU after every step and comes back before
the next one. Moving its state with ``module.to("cpu")`` copies into pageable host memory
(one synchronous copy per tensor, ~6 GB/s) and builds new tensors that the optimizer state
must be re-pointed at. :class:`HostStash` instead copies each storage once into a pinned
host buffer kept for the run, then shrinks the device storage to zero bytes (what FSDP2
itself does with unsharded parameters). Every tensor object, view, DTensor and optimizer
state entry stays the same object; :meth:`HostStash.restore` regrows the storages and
copies the bytes back. Both directions are asynchronous copies from or into pinned memory,
ended by one synchronisation; or the restore runs on a side stream
(``restore(stream=...)``) while the device computes something else, and :meth:`ready`
makes the current stream wait for it before the restored tensors are read (a colocated
trainer's optimizer state comes back during the log-prob pass: nothing reads it before
the first optimizer step).

Between :meth:`HostStash.release` and :meth:`HostStash.restore` the tensors must not be
read: their storages hold no bytes.
"""

from collections.abc import Iterable
from contextlib import nullcontext

import torch


class HostStash:
    """Pinned host copies of the storages behind ``tensors`` (one per distinct storage)."""

    def __init__(self, *, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._host: dict[int, torch.Tensor] = {}  # storage position -> uint8 host buffer
        self._released: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._restoring: torch.cuda.Event | None = None  # end of a side-stream restore

    @property
    def released(self) -> bool:
        return bool(self._released)

    def release(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy the storages of ``tensors`` to host and free them; returns the bytes moved."""
        if self._released:
            raise RuntimeError("HostStash.release called twice without restore")
        self.ready()  # a side-stream restore still writing these storages
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

    def restore(self, *, stream: "torch.cuda.Stream | None" = None) -> int:
        """Regrow every released storage and copy its bytes back; returns the bytes moved.

        Without ``stream`` the host waits for the copies. With a CUDA ``stream`` they are
        queued there, after the work already queued on the current stream, and the host
        goes on: call :meth:`ready` before reading the tensors on another stream. The
        storages are allocated for the current stream either way, and :meth:`release` calls
        :meth:`ready` before it frees them, so the side stream is done with them by then."""
        for storage, host in self._released:  # allocated for the current stream
            storage.resize_(host.numel())
        side = stream is not None and bool(self._released)
        if side:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if side else nullcontext():
            for storage, host in self._released:
                _bytes_of(storage).copy_(host, non_blocking=self.pin)
        if side:
            self._restoring = torch.cuda.Event()
            self._restoring.record(stream)
        moved = sum(host.numel() for _, host in self._released)
        if stream is None:
            _wait((storage for storage, _ in self._released), all_streams=False)
        self._released = []
        return moved

    def ready(self) -> None:
        """The current stream waits (on the device, not the host) for a side-stream
        :meth:`restore`; a no-op when none is pending."""
        if self._restoring is not None:
            torch.cuda.current_stream().wait_event(self._restoring)
            self._restoring = None

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


def _wait(storages: Iterable[torch.UntypedStorage], *, all_streams: bool = True) -> None:
    """The host waits for the device: all its streams, or the current stream only."""
    if any(storage.device.type == "cuda" for storage in storages):
        if all_streams:
            torch.cuda.synchronize()
        else:  # leaves another stash's side-stream restore running
            torch.cuda.current_stream().synchronize()


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None):
    """The optimizer's state tensors (moments, step counters)."""
    for state in optimizer.state.values() if optimizer is not None else ():
        yield from (value for value in state.values() if isinstance(value, torch.Tensor))
