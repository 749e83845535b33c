"""Trainer side of the weight updates: carry ``(hf_name, tensor)`` buckets into engines.

- :func:`update_from_disk`: an HF safetensors directory written atomically, then
  ``/update_weights_from_disk`` on every engine.
- :func:`update_from_tensor`: tensor handles (CUDA IPC on GPU, shared memory on CPU),
  serialized like SGLang's MultiprocessingSerializer, to ``/update_weights_from_tensor``.
- :class:`DistributedWeightSender`: a process group between the trainer (rank 0) and every
  engine, ``/update_weights_from_distributed`` then broadcasts (gloo on CPU, nccl on GPU).

Each call returns once every engine applied the bucket and bumped its weight version.
"""

import asyncio
import base64
import contextlib
import datetime
import io
import os
import shutil
import socket
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import torch

from rl_sglang.client import EngineClient
from rl_sglang.engine.weights import CUDA_DEVICE_ARG, make_process_group, record_view

NamedTensors = Sequence[tuple[str, torch.Tensor]]


def save_weights_atomic(named: NamedTensors, path: str | Path, config_dir=None) -> Path:
    """Write ``model.safetensors`` (plus config/tokenizer files of ``config_dir``) into a
    temporary sibling and rename it to ``path``, so readers never see half a checkpoint."""
    from safetensors.torch import save_file

    path = Path(path)
    staging = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named}
    save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
    for item in Path(config_dir).glob("*.json") if config_dir else []:
        shutil.copy2(item, staging / item.name)
    if path.exists():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, old)
        shutil.rmtree(old)
    os.replace(staging, path)
    return path


async def update_from_disk(
    clients, named: NamedTensors, path, *, weight_version=None, config_dir=None
):
    """Save ``named`` under ``path`` and have every engine load it."""
    await asyncio.to_thread(save_weights_atomic, named, path, config_dir)
    body = {"weight_version": weight_version} if weight_version is not None else {}
    return await asyncio.gather(*(c.update_weights_from_disk(str(path), **body) for c in clients))


@contextlib.contextmanager
def _file_system_sharing():
    """CPU tensors travel as named shared-memory files, which an unrelated process (the
    engine) can open; the default file-descriptor strategy only works between relatives."""
    import torch.multiprocessing as mp

    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(previous)


def bucket_layout(named: NamedTensors) -> list[SimpleNamespace]:
    """One record per tensor of a flattened bucket: name, shape, dtype, start_idx, end_idx
    and numel (its bytes), the byte range it takes in the flat uint8 buffer.

    The records are ``types.SimpleNamespace`` objects: they have the attributes SGLang's
    ``load_format="flattened_bucket"`` reads, and SGLang's restricted unpickler (like the
    embedded engine's) accepts them, so the trainer never needs SGLang installed.
    """
    metadata, offset = [], 0
    for name, tensor in named:
        size = tensor.numel() * tensor.element_size()
        metadata.append(
            SimpleNamespace(
                name=name,
                shape=tensor.shape,
                dtype=tensor.dtype,
                start_idx=offset,
                end_idx=offset + size,
                numel=size,
            )
        )
        offset += size
    return metadata


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def flatten_bucket(named: NamedTensors) -> dict:
    """One new uint8 buffer ``[N_bytes]`` holding every tensor, plus the records of
    :func:`bucket_layout` to cut it back apart."""
    named = list(named)
    flat = torch.cat([_as_bytes(t) for _, t in named])
    return {"flattened_tensor": flat, "metadata": bucket_layout(named)}


class SendBuffer:
    """A flattened bucket kept for the run and filled in place: its storage (device memory,
    or a shared-memory file on CPU) is allocated once, so every later sync hands the engine
    the same tensor handle, which an engine that keeps the rebuilt tensor (the embedded
    engine) never opens again. The layout records of each bucket layout (names, shapes,
    dtypes) are made once too. A bucket larger than the storage, or on another device,
    allocates it anew. Costs its bytes (the largest bucket it held) for as long as it is
    kept; :meth:`release` frees it (the next :meth:`fill` allocates again)."""

    MAX_LAYOUTS = 8  # layouts remembered (a sender streams a few bucket layouts in turn)

    def __init__(self):
        self.storage: torch.Tensor | None = None  # [capacity] uint8
        self._layouts: dict[tuple, tuple[list, list]] = {}  # key -> (metadata, views)
        self.num_allocations = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.storage is None else self.storage.numel()

    def fill(self, named: NamedTensors) -> dict:
        """The bucket ``named`` copied into the kept storage: ``{"flattened_tensor",
        "metadata"}``, SGLang's flattened_bucket (the tensor a view of the storage's first
        bytes). On CUDA the copy has finished on return: the engine reads the buffer from
        another process, outside this stream's order."""
        named = list(named)
        metadata, views = self._layout(named)
        with torch.no_grad():  # one fused copy into views typed like the sources
            torch._foreach_copy_(views, [t for _, t in named])
        if self.storage.is_cuda:
            torch.cuda.current_stream(self.storage.device).synchronize()
        size = metadata[-1].end_idx if metadata else 0
        return {"flattened_tensor": self.storage[:size], "metadata": metadata}

    def _layout(self, named: NamedTensors) -> tuple[list, list]:
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in named)
        device = named[0][1].device if named else torch.device("cpu")
        if key in self._layouts and self.storage.device == device:
            return self._layouts[key]
        metadata = bucket_layout(named)
        size = metadata[-1].end_idx if metadata else 0
        if self.storage is None or size > self.nbytes or self.storage.device != device:
            self.release()
            self.storage = _shared_bytes(max(size, 1), device)
            self.num_allocations += 1
        if len(self._layouts) >= self.MAX_LAYOUTS:
            self._layouts.clear()
        views = [record_view(self.storage, m) for m in metadata]  # typed like the tensors
        self._layouts[key] = (metadata, views)
        return metadata, views

    def release(self) -> None:
        """Drop the storage (an engine still holding its handle keeps the memory until it
        lets go: on GPU torch parks the block until then, on CPU the file stays)."""
        self.storage, self._layouts = None, {}


def _shared_bytes(size: int, device: torch.device) -> torch.Tensor:
    """``[size]`` uint8 another process can open: device memory (CUDA IPC), or on CPU a
    named shared-memory file (made under the file_system strategy, the one the payload is
    pickled with, so pickling does not copy it into another file)."""
    if device.type == "cuda":
        return torch.empty(size, dtype=torch.uint8, device=device)
    with _file_system_sharing():
        return torch.empty(size, dtype=torch.uint8).share_memory_()


def serialize_bucket(named: NamedTensors, *, flatten: bool = False) -> tuple[str, list]:
    """``(base64 payload, keep_alive)``: a ForkingPickler dump of the bucket (CUDA IPC
    handles or shared-memory names, not the bytes), in a fresh buffer, for one receiver.
    Keep ``keep_alive`` referenced until the engine answered: it owns the shared storage."""
    bucket, keep_alive = shareable_bucket(named, flatten=flatten)
    return dump_payload(bucket), keep_alive


def shareable_bucket(named: NamedTensors, *, flatten: bool = False) -> tuple[object, list]:
    """``(bucket, keep_alive)``: the bucket copied into fresh shareable storage, flattened
    (SGLang's flattened_bucket) or as a ``(name, tensor)`` list."""
    if flatten:
        bucket = flatten_bucket(named)
        bucket["flattened_tensor"] = _shareable(bucket["flattened_tensor"])
        return bucket, [bucket["flattened_tensor"]]
    bucket = [(name, _shareable(t)) for name, t in named]
    return bucket, [t for _, t in bucket]


def dump_payload(bucket) -> str:
    """Base64 of a ForkingPickler dump of ``bucket`` (SGLang's MultiprocessingSerializer
    format). Pickled anew each time even for a kept buffer: torch counts every pickled
    reference of a storage (the engine's unpickling releases it), so a payload is sent
    exactly once."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing

    buffer = io.BytesIO()
    with _file_system_sharing():
        pickler = ForkingPickler(buffer)
        for tensor_type in (torch.Tensor, torch.nn.Parameter):
            pickler.dispatch_table[tensor_type] = _reduce_naming_the_gpu
        pickler.dump(bucket)
    return base64.b64encode(buffer.getvalue()).decode()


def _reduce_naming_the_gpu(tensor: torch.Tensor):
    """torch's tensor reduction, with a CUDA tensor's device given by the GPU's UUID, not
    its index: the index is the sender's (Ray hands each training rank its own
    CUDA_VISIBLE_DEVICES), and names another GPU in an engine that sees several. SGLang's
    receivers map the UUID back to their own index (as they do for their own senders); the
    embedded engine does the same (rl_sglang.engine.weights)."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        uuid = str(torch.cuda.get_device_properties(args[CUDA_DEVICE_ARG]).uuid)
        args = (*args[:CUDA_DEVICE_ARG], uuid, *args[CUDA_DEVICE_ARG + 1 :])
    return rebuild, args


def _shareable(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor if tensor.is_cuda else tensor.contiguous().clone().share_memory_()


async def update_from_tensor(
    clients,
    named: NamedTensors,
    *,
    weight_version=None,
    flatten=False,
    tp_size: int = 1,
    buffer: SendBuffer | None = None,
):
    """Send one bucket to every (colocated) engine through tensor handles: one payload per
    TP rank of each engine, as SGLang indexes them (every rank opens the same storage).
    ``buffer``: a kept :class:`SendBuffer` the bucket is copied into (flattened); without
    it, a fresh buffer per call."""
    if buffer is not None:
        bucket, keep_alive, flatten = buffer.fill(named), None, True
    else:
        bucket, keep_alive = shareable_bucket(named, flatten=flatten)
    results = await send_payloads(
        clients,
        payloads_per_receiver(bucket, len(clients), tp_size),
        flatten=flatten,
        weight_version=weight_version,
    )
    del keep_alive
    return results


def payloads_per_receiver(bucket, num_engines: int, tp_size: int) -> list[list[str]]:
    """``[engine][tp rank]`` payloads of ``bucket``, each pickled on its own: torch counts
    every pickled reference of a shared storage and each opening releases one, so a
    payload opened twice (two engines, or two TP ranks) would leave the count short and
    the shared-memory file of a kept buffer never freed."""
    return [[dump_payload(bucket) for _ in range(tp_size)] for _ in range(num_engines)]


async def send_payloads(clients, payloads: list[list[str]], *, flatten=False, weight_version=None):
    """``/update_weights_from_tensor`` to each engine with its own list of serialized
    buckets, one per TP rank (SGLang's TP rank j deserializes item j). The storage behind
    the payloads must stay alive until this returns."""
    body = {"load_format": "flattened_bucket" if flatten else None}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return await asyncio.gather(
        *(
            c.update_weights_from_tensor(per_rank, **body)
            for c, per_rank in zip(clients, payloads, strict=True)
        )
    )


class DistributedWeightSender:
    """Rank 0 of a group with every engine; ``await connect()`` once, ``await send()`` per
    bucket. ``clients`` talk to the engines directly (not through the router).

    The group's store listens on ``master_address`` only (torch's own store binds every
    interface), on ``master_port`` or a port free there, bound when the sender is made so
    that nothing takes it before :meth:`connect`."""

    def __init__(
        self,
        clients: Sequence[EngineClient],
        *,
        master_address="127.0.0.1",
        master_port=None,
        backend="gloo",
        group_name=None,
        tp_size: int = 1,
    ):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (GPU), got {backend!r}")
        if backend == "nccl":
            # SGLang servers run NCCL with cuMem buffers off; both ends of a group must agree,
            # or the first broadcast fails with "Cuda failure 'invalid argument'" (seen on
            # 2xH200). NCCL reads this once per process: set it before any other NCCL use.
            os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        # a fresh name per sender: torch registers groups by name, once per process
        group_name = group_name or f"rl_weight_sync_{uuid.uuid4().hex[:8]}"
        self.clients, self.backend, self.group_name = list(clients), backend, group_name
        self.tp_size = tp_size  # an engine of TP size t takes t consecutive ranks
        self.master_address = master_address
        family = socket.AF_INET6 if ":" in master_address else socket.AF_INET
        self._listener = socket.create_server((master_address, master_port or 0), family=family)
        self.master_port = self._listener.getsockname()[1]
        self.group = None

    @property
    def world_size(self) -> int:
        return 1 + self.tp_size * len(self.clients)

    async def connect(self) -> None:
        fields = dict(
            master_address=self.master_address,
            master_port=self.master_port,
            world_size=self.world_size,
            group_name=self.group_name,
            backend=self.backend,
        )
        joins = [
            asyncio.ensure_future(
                c.init_weights_update_group(rank_offset=1 + i * self.tp_size, **fields)
            )
            for i, c in enumerate(self.clients)
        ]
        self.group = await asyncio.to_thread(self._create_group)
        await asyncio.gather(*joins)

    def _create_group(self):
        from torch.distributed import PrefixStore, TCPStore

        timeout = datetime.timedelta(seconds=120)
        store = TCPStore(
            self.master_address,
            self.master_port,
            self.world_size,
            True,
            timeout=timeout,
            master_listen_fd=self._listener.fileno(),
        )
        self._listener.detach()  # the store owns the descriptor now (and closes it)
        self._store = store  # the master store must outlive the group's rendezvous
        return make_process_group(
            PrefixStore(self.group_name, store),
            0,
            self.world_size,
            self.backend,
            timeout,
            self.group_name,
        )

    async def send(self, named: NamedTensors, *, weight_version=None, flatten=False) -> list[dict]:
        """Announce the bucket to every engine, then broadcast its tensors in order (or,
        with ``flatten``, the whole bucket as one uint8 buffer: one collective per bucket)."""
        if self.group is None:
            raise RuntimeError("call await sender.connect() before send()")
        named = list(named)
        body = {
            "names": [n for n, _ in named],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "group_name": self.group_name,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        if flatten:
            body["load_format"] = "flattened_bucket"
        tensors = [flatten_bucket(named)["flattened_tensor"]] if flatten else [t for _, t in named]
        posts = [
            asyncio.ensure_future(c.update_weights_from_distributed(**body)) for c in self.clients
        ]
        await asyncio.to_thread(self._broadcast, tensors)
        return await asyncio.gather(*posts)

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        for tensor in tensors:
            wire = tensor.detach().contiguous()
            if self.backend == "nccl":  # NCCL sends from this process's current GPU
                wire = wire.to(torch.device("cuda", torch.cuda.current_device()))
            else:
                wire = wire.cpu()
            self.group.broadcast([wire], options).wait()
