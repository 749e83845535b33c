"""Non-finite steps at DP=2 (ZeRO-1), run inside dist_job's two-rank world: one good
step, a NaN advantage on rank 1 only, an inf one on rank 0 only, another good step; beside
a reference backend that takes only the two good steps."""

import dataclasses

import tiny
import torch

LENGTHS = [9, 14, 6, 11]


def clone(obj):
    """A deep copy of tensors inside dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(clone(v) for v in obj)
    return obj


def bit_identical(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(bit_identical(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(bit_identical(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def snapshot(backend) -> dict:
    """Parameters, fp32 masters (bf16), this rank's optimizer state and the step."""
    from rl_megatron import optim

    return clone(
        {
            "params": dict(backend.model.named_parameters()),
            "masters": list(getattr(backend.optimizer, "masters", [])),
            "optim": optim.local_optimizer(backend.optimizer).state_dict(),
            "step": backend.step,
        }
    )


def poisoned(batch, rank: int, bad_rank: int, value: float):
    advantages = batch.advantages.clone()
    if rank == bad_rank:
        advantages[int(batch.loss_mask.nonzero()[0])] = value
    return dataclasses.replace(batch, advantages=advantages)


def nonfinite_checks(hf_path: str, rank: int, precision: str) -> dict:
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    config = MegatronConfig(hf_path=hf_path, device="cpu", lr=1e-3, precision=precision)
    backend, reference = MegatronBackend(config), MegatronBackend(config)
    shard = tiny.random_batch(LENGTHS, seed=11).select([rank, rank + 2])
    good = [backend.train_step(shard)]
    before = snapshot(backend)
    bad = [
        backend.train_step(poisoned(shard, rank, bad_rank=1, value=float("nan"))),
        backend.train_step(poisoned(shard, rank, bad_rank=0, value=float("inf"))),
    ]
    untouched = bit_identical(before, snapshot(backend))
    good.append(backend.train_step(shard))
    expected = [reference.train_step(shard) for _ in range(2)]
    return {
        "bad": bad,
        "good": good,
        "expected": expected,
        "untouched": untouched,
        "same_as_reference": bit_identical(snapshot(backend), snapshot(reference)),
    }
