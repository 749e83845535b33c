"""Which globals a weight bucket from ``/update_weights_from_tensor`` may name.

SGLang's tensor transport is a pickle (torch's multiprocessing reductions: shared-memory or
CUDA IPC handles), so the engine unpickles request bodies. A pickle can call any global it
names, and torch alone offers ways to run code (``torch.utils.cpp_extension.load_inline``,
``torch.hub.load``, ``torch.load(weights_only=False)`` via ``torch.storage._load_from_bytes``),
so a module-prefix rule is not enough: only the exact rebuild helpers, storage classes,
dtypes and containers a bucket needs are allowed. (The endpoint also requires the API key
whenever the engine listens beyond loopback.)
"""

import torch

_REBUILD_MODULE = "torch.multiprocessing.reductions"  # rebuild_tensor, rebuild_cuda_tensor, ...
_EXACT = {
    ("torch", "Size"),
    ("torch", "Tensor"),
    ("torch", "device"),
    ("torch._utils", "_rebuild_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("collections", "OrderedDict"),
    ("types", "SimpleNamespace"),  # flattened-bucket metadata records
    ("_codecs", "encode"),  # bytes in protocol-2 pickles
    *(("builtins", name) for name in ("set", "frozenset", "slice", "bytearray", "complex")),
}


def allowed_global(module: str, name: str) -> bool:
    """True for the globals a serialized bucket legitimately references."""
    if (module, name) in _EXACT:
        return True
    if module == _REBUILD_MODULE:
        return name.startswith("rebuild_")
    if module in ("torch", "torch.storage"):  # dtypes and storage classes, nothing callable else
        value = getattr(torch, name, None) if module == "torch" else None
        return isinstance(value, torch.dtype) or name.endswith("Storage")
    return False
