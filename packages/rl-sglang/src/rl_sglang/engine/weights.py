"""Engine side of the weight updates: copy named HF tensors into the live model.

Three sources, matching SGLang's endpoints: a safetensors directory on disk, serialized
tensor handles (torch multiprocessing reductions: CUDA IPC on GPU, shared memory on CPU),
and a broadcast over a torch.distributed group (gloo on CPU, nccl on GPU) whose rank 0 is
the trainer.
"""

import base64
import datetime
import functools
import io
import math
import pickle
import re
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch

from rl_sglang.engine.safe_pickle import allowed_global

NamedTensors = list[tuple[str, torch.Tensor]]


def copy_into_model(
    model: torch.nn.Module,
    named: Iterable[tuple[str, torch.Tensor]],
    targets: dict[str, torch.Tensor] | None = None,
) -> int:
    """Copy each tensor into the parameter or buffer of that HF name (or, for a checkpoint
    name of a weight transformers fuses in memory, its part: see :func:`live_target`);
    returns how many. ``targets``: the model's ``state_dict()`` when the caller keeps one
    (it shares storage with the live parameters until they move); built here otherwise.

    Raises ValueError on an unknown name or a shape mismatch, before touching the model.
    """
    return run_copy(copy_plan(model, named, targets))


class CopyPlan(NamedTuple):
    """What an update copies where: the model tensors (``destinations``) each source fills.
    ``targets`` is the state dict the destinations were found in: the plan holds while the
    parameters keep that storage. ``reusable``: the sources are the tensors sent (not
    converted copies), so the same plan serves a later update through the same buffer.
    ``cuda_devices``: the CUDA devices the sources are read on (waited for after the copy)."""

    targets: dict
    destinations: list
    sources: list
    reusable: bool
    cuda_devices: frozenset = frozenset()


def copy_plan(
    model: torch.nn.Module,
    named: Iterable[tuple[str, torch.Tensor]],
    targets: dict[str, torch.Tensor] | None = None,
) -> CopyPlan:
    """The checked :class:`CopyPlan` of ``named``: ValueError on an unknown name or a shape
    mismatch (see :func:`copy_into_model`)."""
    targets = model.state_dict() if targets is None else targets  # tied weights share storage
    named = list(named)
    destinations = []
    for name, tensor in named:
        destination = live_target(name, targets)
        if destination is None:
            sample = ", ".join(sorted(targets)[:4])
            raise ValueError(f"unknown weight {name!r}; the model has names like {sample}, ...")
        if tuple(tensor.shape) != tuple(destination.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(destination.shape)}"
            )
        destinations.append(destination)
    sources = [t.to(d.device) for (_, t), d in zip(named, destinations, strict=True)]
    same = all(s is t for s, (_, t) in zip(sources, named, strict=True))
    cuda_devices = frozenset(t.device for t in sources if t.is_cuda)
    return CopyPlan(targets, destinations, sources, same, cuda_devices)


def run_copy(plan: CopyPlan) -> int:
    """Copy every source of ``plan`` into its destination; returns how many. On CUDA the
    copies out of the sender's memory have finished on return: once the update is
    answered the sender may refill that memory (a kept send buffer)."""
    with torch.no_grad():
        torch._foreach_copy_(plan.destinations, plan.sources)  # a few fused launches
    for device in plan.cuda_devices:
        torch.cuda.current_stream(device).synchronize()
    return len(plan.sources)


# A checkpoint's per-expert MoE weight (what Megatron exports and SGLang loads).
_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def live_target(name: str, targets: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The tensor (or view of one) of ``targets`` that HF weight ``name`` fills, None if
    none. transformers 5 keeps Qwen-MoE experts fused in memory: expert e's ``gate_proj``
    and ``up_proj`` are rows ``[:I]`` and ``[I:]`` of ``experts.gate_up_proj[e]``
    ``[E, 2I, h]``, its ``down_proj`` is ``experts.down_proj[e]`` ``[E, h, I]`` (the layout
    its ``save_pretrained`` splits)."""
    if name in targets:
        return targets[name]
    match = _EXPERT.fullmatch(name)
    if match is None:
        return None
    prefix, expert, proj = match[1], int(match[2]), match[3]
    fused = targets.get(f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
    if fused is None or fused.dim() != 3 or expert >= fused.shape[0]:
        return None
    if proj == "down_proj":
        return fused[expert]
    gate, up = fused[expert].chunk(2, dim=0)
    return gate if proj == "gate_proj" else up


def read_safetensors_dir(path: str | Path) -> NamedTensors:
    """Every tensor of every ``*.safetensors`` file in ``path``."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}; write one with save_weights_atomic")
    return [item for file in files for item in load_file(file).items()]


CUDA_DEVICE_ARG = 6  # the storage device among torch's rebuild_cuda_tensor arguments


class _Record(dict):
    """A flattened-bucket record as this engine decodes it. Senders pickle records as
    ``types.SimpleNamespace`` (SGLang reads attributes); built here as a dict of the same
    fields they cost less to unpickle, and a bucket's records compare with a kept
    layout's in one C-level ``==`` (see :class:`HeldBuffers`)."""

    __slots__ = ()
    __setstate__ = dict.update  # pickle's BUILD hands over the namespace's fields


# What the restricted unpickler builds instead of the global a payload names: plain
# tuples for torch.Size (shapes and sizes are only read as tuples here) and dict records.
_DECODED_AS = {("torch", "Size"): tuple, ("types", "SimpleNamespace"): _Record}


class _RestrictedUnpickler(pickle.Unpickler):
    """Only torch's rebuild helpers and plain containers may be loaded from a request."""

    def find_class(self, module: str, name: str):
        if not allowed_global(module, name):  # an exact allowlist: see safe_pickle
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a weight bucket")
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor_on_named_gpu
        return _DECODED_AS.get((module, name)) or super().find_class(module, name)


def _rebuild_cuda_tensor_on_named_gpu(*args):
    """torch's rebuild_cuda_tensor, the storage device given by index or by GPU UUID (as
    rl_sglang.transports and SGLang's senders write it) and mapped to this process's index."""
    from torch.multiprocessing import reductions

    device = args[CUDA_DEVICE_ARG]
    if isinstance(device, str):
        device = local_gpu_index(device)
        args = (*args[:CUDA_DEVICE_ARG], device, *args[CUDA_DEVICE_ARG + 1 :])
    return reductions.rebuild_cuda_tensor(*args)


def local_gpu_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; ValueError when it cannot see it."""
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise ValueError(f"weights arrived on GPU {uuid}, which this engine process cannot see")


def deserialize_bucket(payload: str | bytes) -> object:
    """Inverse of :func:`rl_sglang.transports.serialize_bucket` (base64 of a ForkingPickler
    dump, as SGLang's MultiprocessingSerializer writes it); flattened-bucket records come
    back as dicts and sizes as tuples (see :data:`_DECODED_AS`)."""
    data = base64.b64decode(payload) if isinstance(payload, str) else payload
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def unflatten_bucket(bucket: dict) -> NamedTensors:
    """``{"flattened_tensor": [N] uint8, "metadata": [record, ...]}`` back into named
    tensors (views of the flat buffer). A record has name, shape, dtype, start_idx and
    end_idx, as attributes (SGLang's format) or as dict keys."""
    views = _RecordViews(bucket["flattened_tensor"])
    return [(meta["name"], views.of(meta)) for meta in map(_fields, bucket["metadata"])]


def record_view(flat: torch.Tensor, meta) -> torch.Tensor:
    """The bytes of one flattened-bucket record in the flat uint8 buffer, seen as its dtype
    and shape (a view: writing it fills the buffer, reading it reads the buffer)."""
    meta = _fields(meta)
    dtype = _dtype(meta["dtype"])
    return flat[meta["start_idx"] : meta["end_idx"]].view(dtype).view(tuple(meta["shape"]))


class _RecordViews:
    """:func:`record_view` of one buffer's records in one op each: a strided view of the
    whole buffer seen as the record's dtype (made once per dtype), about half the cost
    over a bucket's records. A record not aligned to its dtype, or not filling its byte
    range within the buffer, goes through :func:`record_view` (which raises)."""

    def __init__(self, flat: torch.Tensor):
        self.flat, self.numel, self.offset = flat, flat.numel(), flat.storage_offset()
        self.typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}  # view, its offset

    def of(self, meta: dict) -> torch.Tensor:
        dtype, shape = _dtype(meta["dtype"]), tuple(meta["shape"])
        start, end, itemsize = meta["start_idx"], meta["end_idx"], dtype.itemsize
        fits = start >= 0 and end <= self.numel and end - start == math.prod(shape) * itemsize
        if not fits or start % itemsize or self.offset % itemsize:
            return record_view(self.flat, meta)
        if dtype not in self.typed:
            view = self.flat[: self.numel - self.numel % itemsize].view(dtype)
            self.typed[dtype] = (view, view.storage_offset())
        view, offset = self.typed[dtype]
        return view.as_strided(shape, _contiguous_strides(shape), offset + start // itemsize)


@functools.lru_cache(maxsize=1024)  # a model's few shapes, over and over
def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _dtype(dtype) -> torch.dtype:
    """A record's dtype: a torch.dtype, or its name (``"torch.bfloat16"``, ``"bfloat16"``)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, str(dtype).removeprefix("torch."))


def _fields(meta) -> dict:
    """A record's fields: SGLang's records carry them as attributes, ours may be dicts."""
    return meta if isinstance(meta, dict) else vars(meta)


def named_tensors_from_payload(serialized: list, load_format: str | None) -> NamedTensors:
    """Decode the first entry of ``serialized_named_tensors`` (one per TP rank; we run TP 1)."""
    obj = _first_bucket(serialized, load_format)
    return unflatten_bucket(obj) if load_format == "flattened_bucket" else _as_named(obj)


def _first_bucket(serialized: list, load_format: str | None) -> object:
    if not serialized:
        raise ValueError("serialized_named_tensors is empty")
    if load_format not in (None, "direct", "flattened_bucket"):
        raise ValueError(f"unsupported load_format {load_format!r}; use None or 'flattened_bucket'")
    return deserialize_bucket(serialized[0])


def _as_named(obj) -> NamedTensors:
    return [(str(name), tensor) for name, tensor in obj]


class KeptBucket(list):
    """The named views of a flattened bucket whose buffer :class:`HeldBuffers` holds. The
    same object comes back for every later update through that buffer with the same
    layout, so a receiver can keep what it derives from it on it (``plan``: the engine's
    :class:`CopyPlan`) instead of deriving it again at every update. ``where``: the
    bucket's ``(storage offset, bytes)`` in its buffer; ``records``: its layout records."""

    plan: CopyPlan | None = None

    def __init__(self, named: NamedTensors, where: tuple[int, int], records: list):
        super().__init__(named)
        self.where, self.records = where, records


class HeldBuffers:
    """The flattened buckets of the last tensor updates, kept open so that a sender that
    fills the same buffer again (:class:`rl_sglang.transports.SendBuffer`) hands a handle
    this process still has open: torch's sharing cache
    (``torch.multiprocessing.reductions.shared_cache``) then rebuilds the tensor on the
    mapping it holds instead of opening the CUDA IPC handle or shared-memory file again,
    and the bucket's views (a :class:`KeptBucket`) are reused instead of cut again.

    At most ``limit`` buffers, one storage each (a sender streams through two), and
    ``layouts`` bucket layouts per buffer; a new one pushes the oldest out. They are held
    across memory releases (the sender keeps them for the run: they are its memory, and
    one it has freed stays parked only until pushed out); :meth:`drop` lets go of all, on
    shutdown. A per-tensor payload (a handle per tensor, fresh at every update) is not
    held."""

    def __init__(self, limit: int = 2, layouts: int = 8):
        self.limit, self.layouts = limit, layouts
        self._held: OrderedDict[tuple, list[KeptBucket]] = OrderedDict()

    def named_tensors(self, serialized: list, load_format: str | None) -> NamedTensors:
        """:func:`named_tensors_from_payload`, a flattened bucket held as a KeptBucket."""
        obj = _first_bucket(serialized, load_format)
        if load_format != "flattened_bucket":
            return _as_named(obj)
        flat = obj["flattened_tensor"]
        storage = (flat.device, flat.untyped_storage().data_ptr())
        kept = self._held.pop(storage, None) or []
        self._held[storage] = kept  # the most recent last
        while len(self._held) > self.limit:
            self._held.popitem(last=False)
        return _kept_bucket(kept, obj, self.layouts)

    def drop(self) -> None:
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)


def _kept_bucket(kept: list[KeptBucket], bucket: dict, limit: int) -> KeptBucket:
    """The KeptBucket of ``kept`` (one buffer's layouts, the most recent last) cut by the
    same records at the same place as ``bucket``, moved to the end; else a new one
    appended (at most ``limit`` kept). The records compare whole, in C: no key is built
    per record."""
    flat, records = bucket["flattened_tensor"], bucket["metadata"]
    where = (flat.storage_offset(), flat.numel())
    for index in range(len(kept) - 1, -1, -1):
        if kept[index].where == where and kept[index].records == records:
            kept.append(kept.pop(index))
            return kept[-1]
    kept.append(KeptBucket(unflatten_bucket(bucket), where, records))
    del kept[:-limit]
    return kept[-1]


class WeightReceiver:
    """The engine's end of a weight-update group: rank ``rank`` of ``world_size``,
    receiving broadcasts from rank 0 (the trainer)."""

    def __init__(self, *, master_address, master_port, rank, world_size, group_name, backend):
        from torch.distributed import PrefixStore, TCPStore

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        timeout = datetime.timedelta(seconds=120)
        store = TCPStore(master_address, int(master_port), world_size, False, timeout=timeout)
        self.group = make_process_group(
            PrefixStore(group_name, store), rank, world_size, backend, timeout, group_name
        )
        self.backend = backend

    def receive(
        self, names, dtypes, shapes, device: torch.device, load_format=None
    ) -> NamedTensors:
        """One broadcast per tensor, or with ``load_format="flattened_bucket"`` one
        broadcast of the whole bucket as uint8 bytes in ``names`` order (SGLang's layout)."""
        recv_device = device if self.backend == "nccl" else torch.device("cpu")
        if load_format == "flattened_bucket":
            return self._receive_flat(names, dtypes, shapes, recv_device)
        if load_format not in (None, "direct"):
            raise ValueError(
                f"unsupported load_format {load_format!r}; use None or 'flattened_bucket'"
            )
        named = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            dtype = getattr(torch, str(dtype).removeprefix("torch."))
            buffer = torch.empty(shape, dtype=dtype, device=recv_device)
            self.group.broadcast([buffer], _root(0)).wait()
            named.append((name, buffer))
        return named

    def _receive_flat(self, names, dtypes, shapes, device) -> NamedTensors:
        dtypes = [getattr(torch, str(d).removeprefix("torch.")) for d in dtypes]
        sizes = [math.prod(shape) * d.itemsize for d, shape in zip(dtypes, shapes, strict=True)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        self.group.broadcast([flat], _root(0)).wait()
        named, offset = [], 0
        for name, dtype, shape, size in zip(names, dtypes, shapes, sizes, strict=True):
            named.append((name, flat[offset : offset + size].view(dtype).view(tuple(shape))))
            offset += size
        return named


def make_process_group(store, rank: int, world_size: int, backend: str, timeout, group_name: str):
    """A standalone gloo or nccl group (not torch.distributed's default group), built the
    way SGLang's ``init_custom_process_group`` builds its end: the store prefixed with the
    group name, then torch's own group helper (which adds its key prefixes), so a trainer
    using this function and a real SGLang server meet at the same store keys."""
    import inspect

    from torch.distributed import distributed_c10d as c10d

    helper = c10d._new_process_group_helper
    options_name = (
        "backend_options"
        if "backend_options" in inspect.signature(helper).parameters
        else "pg_options"
    )
    group, _ = helper(
        world_size,
        rank,
        [],
        backend,
        store,
        group_name=group_name,
        timeout=timeout,
        **{options_name: None},
    )
    return group


def _root(rank: int):
    options = torch.distributed.BroadcastOptions()
    options.rootRank = rank
    return options
