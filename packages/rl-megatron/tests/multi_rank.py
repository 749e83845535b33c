"""What the multi-rank tests share: spawning a gloo job on 127.0.0.1, the one-rank
reference a layout is compared with, and the comparison of one training step."""

import os
from collections.abc import Callable

import pytest
import tiny
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_job import LENGTHS, POLICY

from rl_core.distributed import free_port

STEP_METRICS = ("loss/total", "loss/pg", "actor/entropy", "pg/clipfrac")


def spawn_gloo(checks: Callable, world: int, out_path, *args):
    """``checks(rank, *args)`` on ``world`` fresh processes joined in a gloo group (the
    megatron CPU shim installed); returns what rank 0's call returned."""
    mp.spawn(_rank, args=(checks, world, free_port(), str(out_path), args), nprocs=world)
    return torch.load(out_path, weights_only=False)


def _rank(rank: int, checks: Callable, world: int, port: int, out_path: str, args: tuple):
    from rl_megatron.testing import cpu_shim

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cpu_shim.install()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = checks(rank, *args)
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


def one_rank_reference(hf_path, train_step: bool = False) -> dict:
    """The full batch in one micro-batch on this process's one rank: log-probs, the
    metrics and HF-named gradients of a forward/backward; with ``train_step``, the
    log-probs after one optimizer step too."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    backend = MegatronBackend(MegatronConfig(hf_path=hf_path, **POLICY))
    batch = tiny.random_batch(LENGTHS, seed=11)
    result = {"log_probs": backend.compute_log_probs(batch)}
    result["metrics"] = backend.forward_backward(batch)
    result["grads"] = backend.hf_gradients()
    if train_step:
        backend.optimizer.zero_grad()
        backend.train_step(batch)
        result["log_probs_after_step"] = backend.compute_log_probs(batch)
    return result


def assert_same_step(got: dict, expected: dict, metrics: tuple = STEP_METRICS) -> None:
    """``metrics`` (the loss terms), every HF-named gradient and the global grad norm of a
    split forward/backward equal the unsplit one's."""
    for key in metrics:
        assert got["metrics"][key] == pytest.approx(expected["metrics"][key], abs=1e-5), key
    assert set(got["grads"]) == set(expected["grads"])
    for hf_name, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][hf_name], grad, atol=1e-5, rtol=1e-4, msg=hf_name)
    full_norm = torch.stack([g.norm() for g in expected["grads"].values()]).norm()
    assert got["grad_norm"] == pytest.approx(float(full_norm), rel=1e-5)
