"""Shared pytest hooks for every package's tests: GPU tests skip cleanly without CUDA."""

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; run on the GPU machine: python -m pytest -m gpu")
    for item in gpu_items:
        item.add_marker(skip)
