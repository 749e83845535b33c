"""Fixtures: tiny HF model directories and a one-rank gloo group (megatron on the CPU shim)."""

import os

import pytest
import tiny
import torch
import torch.distributed as dist

from rl_core.distributed import free_port


@pytest.fixture(scope="session")
def world1():
    """This pytest process as a one-rank gloo world with megatron's groups at TP=1."""
    from rl_megatron.parallel import initialize_parallel
    from rl_megatron.testing import cpu_shim

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cpu_shim.install()
    dist.init_process_group("gloo", rank=0, world_size=1)
    initialize_parallel(tp=1, device="cpu")
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """``{name: (directory, hf_model)}`` of the tiny models every test shares."""
    root = tmp_path_factory.mktemp("hf")
    specs = {
        "qwen2-tied": ("qwen2", True, 0),
        "qwen3": ("qwen3", False, 1),
        "llama": ("llama", False, 2),
        "qwen3-ref": ("qwen3", False, 3),
        "qwen3-moe": ("qwen3_moe", False, 5),
        "deepseek_v3": ("deepseek_v3", False, 7),  # sigmoid router, groups, expert bias
        "deepseek_v3-4layers": ("deepseek_v3-4layers", False, 7),  # for pp=2
    }
    dirs = {}
    for name, (family, tie, seed) in specs.items():
        directory = root / name
        dirs[name] = (directory, tiny.save_tiny_model(directory, family, tie=tie, seed=seed))
    deep = root / "qwen3-4layers"  # two layers per stage at pp=2: one per virtual stage
    dirs["qwen3-4layers"] = (deep, tiny.save_tiny_model(deep, "qwen3", seed=6, num_hidden_layers=4))
    deep_moe = root / "qwen3-moe-4layers"  # the same with experts (virtual stages with EP)
    dirs["qwen3-moe-4layers"] = (
        deep_moe,
        tiny.save_tiny_model(deep_moe, "qwen3_moe", seed=8, num_hidden_layers=4),
    )
    return dirs
