"""Device memory handed back and restored in place, through pinned host buffers.

Colocated with engines, the trainer leaves the GPU after every step and comes back before
the next one. Moving its state with ``module.to("cpu")`` copies into pageable host memory
(one synchronous copy per tensor, ~6 GB/s) and builds new tensors that the optimizer state
must be re-pointed at. :class:`HostStash` instead copies each storage once into a pinned
host buffer kept for the run, then shrinks the device storage to zero bytes (what FSDP2
itself does with unsharded parameters). Every tensor object, view, DTensor and optimizer
state entry stays the same object; :meth:`HostStash.restore` regrows the storages and
copies the bytes back.

The copies run at the PCIe bound, so they are hidden behind other work rather than made
faster. On CUDA a release queues its copies on a side stream; with ``wait=False`` it
returns at once and the storages are freed only once the copies completed
(:meth:`HostStash.settle`, which :func:`settle_in_background` calls from a thread, so the
memory goes back while the engines generate). A restore with ``wait=False`` likewise
queues its copies on the side stream; :meth:`HostStash.ready` makes the current stream
wait for them before the first kernel that reads the tensors.

Between :meth:`HostStash.release` and :meth:`HostStash.restore` the tensors must not be
read or written: their storages hold no bytes, or are being copied out.
"""

import threading
from collections.abc import Callable, Iterable
from contextlib import nullcontext

import torch


class HostStash:
    """Pinned host copies of the storages behind ``tensors`` (one per distinct storage)."""

    def __init__(self, *, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._host: dict[int, torch.Tensor] = {}  # storage position -> uint8 host buffer
        self._released: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._copied_out: torch.cuda.Event | None = None  # a release's copies, until freed
        self._unfreed = False  # released storages still hold their bytes (copies queued)
        self._copied_in: torch.cuda.Event | None = None  # a restore(wait=False)'s copies
        self._stream: torch.cuda.Stream | None = None  # made with the first CUDA copy
        self._lock = threading.Lock()  # settle() runs from a drain thread too

    @property
    def released(self) -> bool:
        return bool(self._released)

    @property
    def settled(self) -> bool:
        """No release's storages are waiting to be freed."""
        return not self._unfreed

    def release(self, tensors: Iterable[torch.Tensor], *, wait: bool = True) -> int:
        """Copy the storages of ``tensors`` to host and free them; returns the bytes moved.
        ``wait=False``: the copies are queued and the storages freed by :meth:`settle`
        (the tensors must be left alone until then; on CPU the copies are done on return)."""
        if self._released:
            raise RuntimeError("HostStash.release called twice without restore")
        storages = list(_distinct_storages(tensors).values())
        self.ready()  # an unfinished restore's bytes are what we copy out
        with self._side_stream(storages):
            # buffers are matched by position: a regrown storage has a new address
            for key, storage in enumerate(storages):
                host = self._host_buffer(key, storage.nbytes())
                host.copy_(_bytes_of(storage), non_blocking=self.pin)
                self._released.append((storage, host))
            self._copied_out = _record_event(storages)
        self._unfreed = True
        if wait:
            self.settle()
        return sum(host.numel() for _, host in self._released)

    def settle(self) -> None:
        """Wait for the last release's copies and free its storages (nothing if done)."""
        with self._lock:
            if not self._unfreed:
                return
            if self._copied_out is not None:
                self._copied_out.synchronize()
            for storage, _ in self._released:
                storage.resize_(0)
            self._copied_out, self._unfreed = None, False

    def restore(self, *, wait: bool = True) -> int:
        """Regrow every released storage and copy its bytes back; returns the bytes moved.
        ``wait=True``: on the current stream, done on return. ``wait=False``: queued on the
        side stream; call :meth:`ready` before the tensors are used."""
        self.settle()  # a release still copying out: its bytes are not all on the host yet
        if not self._released:
            return 0
        storages = [storage for storage, _ in self._released]
        for storage, host in self._released:
            storage.resize_(host.numel())
        with self._side_stream(storages, use=not wait):
            for storage, host in self._released:
                _bytes_of(storage).copy_(host, non_blocking=self.pin)
            event = _record_event(storages)
        if wait and event is not None:
            event.synchronize()
        elif not wait:
            self._copied_in = event
        self._released = []
        return sum(storage.nbytes() for storage in storages)

    def ready(self) -> None:
        """The current stream waits for a :meth:`restore` (``wait=False``)'s copies."""
        if self._copied_in is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self._copied_in)
            self._copied_in = None

    def _side_stream(self, storages: list[torch.UntypedStorage], *, use: bool = True):
        """Context: the copies of CUDA ``storages`` on this stash's side stream, after the
        current stream's work (which wrote them, or last used their new blocks); a no-op
        on CPU or with ``use=False``."""
        device = next((s.device for s in storages if s.device.type == "cuda"), None)
        if device is None or not use:
            return nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        return torch.cuda.stream(self._stream)

    def _host_buffer(self, key: int, nbytes: int) -> torch.Tensor:
        host = self._host.get(key)
        if host is None or host.numel() != nbytes:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self._host[key] = host
        return host


def settle_in_background(
    stashes: list[HostStash], device: torch.device, then: Callable[[], None]
) -> threading.Thread:
    """A thread that waits for the stashes' releases to finish copying, frees their
    storages and calls ``then`` (e.g. ``torch.cuda.empty_cache``: the memory back to the
    driver). Join it before touching the tensors again."""

    def drain() -> None:
        with torch.cuda.device(device):
            for stash in stashes:
                stash.settle()
            then()

    thread = threading.Thread(target=drain, name="host-stash-drain", daemon=True)
    thread.start()
    return thread


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


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The first-byte addresses of ``tensors``' (non-empty) storages."""
    return set(_distinct_storages(tensors))


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _record_event(storages: list[torch.UntypedStorage]) -> torch.cuda.Event | None:
    """An event after the copies just queued on the current stream (None on CPU)."""
    device = next((s.device for s in storages if s.device.type == "cuda"), None)
    if device is None:
        return None
    return torch.cuda.current_stream(device).record_event()


def training_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
    """Parameters and optimizer state tensors (step counters included: a fused AdamW keeps
    them on the device). Gradients are not state: drop them before releasing."""
    yield from model.parameters()
    for state in optimizer.state.values() if optimizer is not None else ():
        yield from (value for value in state.values() if isinstance(value, torch.Tensor))
