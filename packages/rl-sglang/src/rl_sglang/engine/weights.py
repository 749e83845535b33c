"""Engine side of the weight updates: copy named HF tensors into the live model.

Three sources, matching SGLang's endpoints: a safetensors directory on disk, serialized
tensor handles (torch multiprocessing reductions: CUDA IPC on GPU, shared memory on CPU),
and a broadcast over a torch.distributed group (gloo on CPU, nccl on GPU) whose rank 0 is
the trainer.
"""

import base64
import datetime
import io
import pickle
from collections.abc import Iterable
from pathlib import Path

import torch

NamedTensors = list[tuple[str, torch.Tensor]]
# Modules a serialized bucket may reference: torch's rebuild functions, dtypes and storages.
_SAFE_MODULE_PREFIXES = ("torch", "collections", "builtins", "copyreg", "_codecs")
_UNSAFE_BUILTINS = {"eval", "exec", "compile", "open", "__import__", "getattr", "setattr"}


def copy_into_model(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each tensor into the parameter or buffer of that HF name; returns how many.

    Raises ValueError on an unknown name or a shape mismatch, before touching the model.
    """
    targets = model.state_dict()  # shares storage with the live parameters (tied ones too)
    named = list(named)
    for name, tensor in named:
        if name not in targets:
            sample = ", ".join(sorted(targets)[:4])
            raise ValueError(f"unknown weight {name!r}; the model has names like {sample}, ...")
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(targets[name].shape)}"
            )
    with torch.no_grad():
        for name, tensor in named:
            targets[name].copy_(tensor.to(targets[name].device))
    return len(named)


def read_safetensors_dir(path: str | Path) -> NamedTensors:
    """Every tensor of every ``*.safetensors`` file in ``path``."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}; write one with save_weights_atomic")
    return [item for file in files for item in load_file(file).items()]


class _RestrictedUnpickler(pickle.Unpickler):
    """Only torch's rebuild helpers and plain containers may be loaded from a request."""

    def find_class(self, module: str, name: str):
        allowed = module.split(".")[0] in _SAFE_MODULE_PREFIXES and name not in _UNSAFE_BUILTINS
        if not allowed:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a weight bucket")
        return super().find_class(module, name)


def deserialize_bucket(payload: str | bytes) -> object:
    """Inverse of :func:`rl_sglang.transports.serialize_bucket` (base64 of a ForkingPickler
    dump, as SGLang's MultiprocessingSerializer writes it)."""
    data = base64.b64decode(payload) if isinstance(payload, str) else payload
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def unflatten_bucket(bucket: dict) -> NamedTensors:
    """``{"flattened_tensor": [N], "metadata": [{name, shape, dtype, start_idx, end_idx}]}``
    back into named tensors (views of the flat buffer)."""
    flat = bucket["flattened_tensor"]
    named = []
    for meta in bucket["metadata"]:
        chunk = flat[meta["start_idx"] : meta["end_idx"]]
        dtype = getattr(torch, str(meta["dtype"]).removeprefix("torch."))
        named.append((meta["name"], chunk.view(dtype).view(meta["shape"])))
    return named


def named_tensors_from_payload(serialized: list, load_format: str | None) -> NamedTensors:
    """Decode the first entry of ``serialized_named_tensors`` (one per TP rank; we run TP 1)."""
    if not serialized:
        raise ValueError("serialized_named_tensors is empty")
    obj = deserialize_bucket(serialized[0])
    if load_format == "flattened_bucket":
        return unflatten_bucket(obj)
    if load_format not in (None, "direct"):
        raise ValueError(f"unsupported load_format {load_format!r}; use None or 'flattened_bucket'")
    return [(str(name), tensor) for name, tensor in obj]


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
            PrefixStore(group_name, store), rank, world_size, backend, timeout
        )
        self.backend = backend

    def receive(self, names, dtypes, shapes, device: torch.device) -> NamedTensors:
        recv_device = device if self.backend == "nccl" else torch.device("cpu")
        named = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            dtype = getattr(torch, str(dtype).removeprefix("torch."))
            buffer = torch.empty(shape, dtype=dtype, device=recv_device)
            self.group.broadcast([buffer], _root(0)).wait()
            named.append((name, buffer))
        return named


def make_process_group(store, rank: int, world_size: int, backend: str, timeout):
    """A standalone gloo or nccl group (not torch.distributed's default group)."""
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)
    options = torch.distributed.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return torch.distributed.ProcessGroupNCCL(store, rank, world_size, options)


def _root(rank: int):
    options = torch.distributed.BroadcastOptions()
    options.rootRank = rank
    return options
