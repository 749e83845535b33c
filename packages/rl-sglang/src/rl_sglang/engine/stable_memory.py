"""Device memory that keeps its addresses across a release (CUDA virtual memory).

A colocated engine hands its memory to the trainer between rollouts. Freed and allocated
again, its weights and KV cache would come back at new addresses, and every CUDA graph
captured against them would have to be captured again (0.4-0.6 s a turn for a 0.5B model).
Here the engine reserves a virtual address range once and maps physical memory into it
(the driver's ``cuMemAddressReserve`` / ``cuMemCreate`` / ``cuMemMap``): a release unmaps
and frees the physical memory, a resume maps fresh memory at the same addresses, so the
captured graphs stay valid. This is what SGLang gets from ``torch_memory_saver``; the
driver calls are made through ``ctypes``, so nothing is compiled.

:class:`StableMemory` hands out tensors from one such range. Its first ``kept_bytes``
(the weights) are copied to pinned host memory on release and back on resume; the rest
(fused weight copies, KV cache) come back zeroed and are rebuilt by their owner.
"""

import ctypes
import logging
import math

import torch

logger = logging.getLogger(__name__)

ALIGN = 512  # bytes between tensors: any dtype, and the fused kernels' vector loads
_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_ON_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED (device memory that cannot be paged)
_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_P, _U64, _SIZE, _INT = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int
_SIGNATURES = {
    "cuDeviceGet": [_P, _INT],
    "cuDeviceGetAttribute": [_P, _INT, _INT],
    "cuGetErrorString": [_INT, _P],
    "cuMemGetAllocationGranularity": [_P, _P, _INT],
    "cuMemAddressReserve": [_P, _SIZE, _SIZE, _U64, _U64],
    "cuMemCreate": [_P, _SIZE, _P, _U64],
    "cuMemMap": [_U64, _SIZE, _SIZE, _U64, _U64],
    "cuMemSetAccess": [_U64, _SIZE, _P, _SIZE],
    "cuMemUnmap": [_U64, _SIZE],
    "cuMemRelease": [_U64],
    "cuMemAddressFree": [_U64, _SIZE],
}


class DriverError(RuntimeError):
    pass


class _Driver:
    """The few CUDA driver calls a :class:`VirtualRegion` needs, raising on failure."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        for name, argtypes in _SIGNATURES.items():  # 64-bit arguments must not pass as int
            getattr(self.lib, name).argtypes = argtypes

    def __call__(self, name: str, *args) -> None:
        result = getattr(self.lib, name)(*args)
        if result != 0:
            message = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(message))
            text = message.value.decode() if message.value else "unknown error"
            raise DriverError(f"{name} failed with CUDA error {result}: {text}")

    def device(self, ordinal: int) -> int:
        device = ctypes.c_int()
        self("cuDeviceGet", ctypes.byref(device), ordinal)
        return device.value

    def supports_vmm(self, ordinal: int) -> bool:
        value = ctypes.c_int()
        self("cuDeviceGetAttribute", ctypes.byref(value), _VMM_SUPPORTED, self.device(ordinal))
        return bool(value.value)


class _CudaArray:
    """What ``torch.as_tensor`` needs to view raw device memory (no copy, no ownership)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 2,
        }


class VirtualRegion:
    """``nbytes`` of device memory at an address that survives :meth:`unmap` / :meth:`map`.
    ``bytes`` is a uint8 tensor over the whole range; using it (or any view of it) while
    unmapped is an illegal address on the device, so the owner must not."""

    def __init__(self, nbytes: int, device: torch.device):
        self.ordinal = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.synchronize(self.ordinal)  # the primary context is current on this thread
        self.driver = _Driver()
        if not self.driver.supports_vmm(self.ordinal):
            raise DriverError(f"cuda:{self.ordinal} has no virtual memory management")
        self.prop = _AllocationProp(type=_PINNED, location=_Location(_ON_DEVICE, self.ordinal))
        granularity = ctypes.c_size_t()
        self.driver(
            "cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self.prop), 0
        )
        self.nbytes = -(-max(nbytes, 1) // granularity.value) * granularity.value
        address = ctypes.c_uint64()
        self.driver(
            "cuMemAddressReserve", ctypes.byref(address), self.nbytes, granularity.value, 0, 0
        )
        self.address, self.handle = address.value, None
        try:
            self.map()
        except DriverError:  # no memory for it now: give the addresses back too
            self.driver("cuMemAddressFree", self.address, self.nbytes)
            raise
        device = torch.device("cuda", self.ordinal)
        self.bytes = torch.as_tensor(_CudaArray(self.address, self.nbytes), device=device)

    @property
    def mapped(self) -> bool:
        return self.handle is not None

    def map(self) -> None:
        """Back the range with fresh physical memory (its contents undefined); on failure
        (out of memory: someone else holds it) the range stays unmapped."""
        handle = ctypes.c_uint64()
        self.driver("cuMemCreate", ctypes.byref(handle), self.nbytes, ctypes.byref(self.prop), 0)
        try:
            self.driver("cuMemMap", self.address, self.nbytes, 0, handle.value, 0)
        except DriverError:
            self.driver("cuMemRelease", handle.value)
            raise
        access = _AccessDesc(_Location(_ON_DEVICE, self.ordinal), _READ_WRITE)
        try:
            self.driver("cuMemSetAccess", self.address, self.nbytes, ctypes.byref(access), 1)
        except DriverError:
            self.driver("cuMemUnmap", self.address, self.nbytes)
            self.driver("cuMemRelease", handle.value)
            raise
        self.handle = handle.value

    def unmap(self) -> None:
        """Give the physical memory back to the device; the addresses stay reserved."""
        torch.cuda.synchronize(self.ordinal)
        self.driver("cuMemUnmap", self.address, self.nbytes)
        self.driver("cuMemRelease", self.handle)
        self.handle = None


class StableMemory:
    """Tensors carved from one :class:`VirtualRegion` in order; those taken before
    :meth:`keep_contents` are copied to pinned host memory by :meth:`release` and back by
    :meth:`restore`, the others come back zeroed. ``region`` is any object with ``bytes``,
    ``map()``, ``unmap()`` and ``mapped`` (a :class:`VirtualRegion` on CUDA)."""

    def __init__(self, region):
        self.region, self.used, self.kept_bytes = region, 0, 0
        self.host: torch.Tensor | None = None  # the kept bytes while released
        self.contents_kept = True  # whether the last release kept them (restore copies back)

    @classmethod
    def for_bytes(cls, nbytes: int, device: torch.device) -> "StableMemory | None":
        """Stable memory of ``nbytes`` on ``device``; None (with the reason logged) where
        the device or driver cannot give it, and the caller frees and reallocates instead."""
        if device.type != "cuda":
            return None
        try:
            return cls(VirtualRegion(nbytes, device))
        except (OSError, DriverError, AttributeError) as error:
            logger.warning("no address-stable device memory (%s): a release frees it", error)
            return None

    @staticmethod
    def size_of(specs) -> int:
        """Bytes :meth:`take` needs for ``(shape, dtype)`` specs, alignment included."""
        return sum(_aligned(_nbytes(shape, dtype)) for shape, dtype in specs)

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = _nbytes(shape, dtype)
        if self.used + nbytes > self.region.bytes.numel():
            raise ValueError(
                f"stable memory exhausted: {nbytes} bytes asked, "
                f"{self.region.bytes.numel() - self.used} left"
            )
        view = self.region.bytes[self.used : self.used + nbytes].view(dtype).view(shape)
        self.used += _aligned(nbytes)
        return view

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` in this memory."""
        return self.take(tensor.shape, tensor.dtype).copy_(tensor)

    def keep_contents(self) -> None:
        """What was taken so far survives releases (the weights)."""
        self.kept_bytes = self.used

    @property
    def released(self) -> bool:
        return not self.region.mapped

    def release(self, *, keep: bool = True) -> None:
        """Unmap the memory. With ``keep`` the kept bytes (the weights) wait in pinned host
        memory for :meth:`restore`; without it they are dropped, and come back zeroed, for
        a caller about to overwrite them (a weight update): no copy either way."""
        if self.released:
            return
        if keep:
            kept = self.region.bytes[: self.kept_bytes]
            if self.host is None:
                pinned = self.region.bytes.is_cuda  # pinned: the copies back run at full speed
                self.host = torch.empty(self.kept_bytes, dtype=torch.uint8, pin_memory=pinned)
            self.host.copy_(kept)
        self.contents_kept = keep
        self.region.unmap()

    def restore(self) -> None:
        if not self.released:
            return
        self.region.map()
        start = self.kept_bytes if self.contents_kept else 0
        if start:
            self.region.bytes[:start].copy_(self.host, non_blocking=True)
        self.region.bytes[start:].zero_()

    @property
    def nbytes(self) -> int:
        return self.region.bytes.numel()


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
