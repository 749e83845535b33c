"""The few collectives the backend needs, and the data-parallel split of a batch.

The process-group setup (``init_distributed``, ``DistInfo``, ``free_port``) lives in
:mod:`rl_core.distributed`, shared with rl-megatron and the launcher.
"""

import torch
import torch.distributed as dist

from rl_core.batch import TrainBatch, to_device
from rl_core.packing import balanced_partitions


def all_reduce_sum(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum scalar metrics over all ranks (one collective; keys must agree on every rank)."""
    if not values or dist.get_world_size() == 1:
        return dict(values)
    keys = sorted(values)
    stacked = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(stacked)
    return dict(zip(keys, stacked.tolist(), strict=True))


def add_metrics(sums: dict, metrics: dict) -> None:
    """``sums[key] += value`` in float64, tensors staying on their device (no read-back).
    Float64 on the device rounds exactly as Python floats do, so reading the sums back
    once gives the same floats as reading every micro-batch's value."""
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().to(torch.float64)
        sums[key] = sums.get(key, 0.0) + value


def all_reduce_metrics(
    values: dict, device: torch.device, *, unreduced: dict | None = None
) -> dict[str, float]:
    """:func:`all_reduce_sum` for floats and 0-d device tensors, read back ONCE; the
    ``unreduced`` ones (e.g. the already global grad norm) ride along unsummed."""
    keys = sorted(values)
    lazy = [k for k in keys if isinstance(values[k], torch.Tensor)]
    eager = [k for k in keys if not isinstance(values[k], torch.Tensor)]
    host = torch.tensor([float(values[k]) for k in eager], dtype=torch.float64)
    parts = [torch.stack([values[k].to(torch.float64) for k in lazy])] if lazy else []
    stacked = torch.cat([*parts, to_device(host, device)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stacked)
    extra = sorted(unreduced or {})
    if extra:
        norms = [torch.as_tensor(unreduced[k]).detach().reshape(1) for k in extra]
        stacked = torch.cat([stacked, *(n.to(stacked.device, torch.float64) for n in norms)])
    out = dict(zip(lazy + eager + extra, stacked.tolist(), strict=True))
    return {key: out[key] for key in keys + extra}


def all_reduce_max_int(value: int, device: torch.device) -> int:
    if dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def global_denominators(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """The batch with ``global_num_tokens/seqs`` summed over ranks, unless already set."""
    if batch.global_num_tokens is not None and batch.global_num_seqs is not None:
        return batch
    local = batch.with_global_denominators()
    summed = all_reduce_sum(
        {"tokens": local.global_num_tokens, "seqs": local.global_num_seqs}, device
    )
    local.global_num_tokens, local.global_num_seqs = summed["tokens"], summed["seqs"]
    return local


def shard_for_rank(batch: TrainBatch, rank: int, world_size: int) -> TrainBatch:
    """This rank's part of a global batch, sequences balanced by tokens across ranks
    (rl_core.packing.balanced_partitions); global denominators are those of ``batch``."""
    if batch.global_num_tokens is None or batch.global_num_seqs is None:
        batch = batch.with_global_denominators()
    parts = balanced_partitions(batch.seq_lengths(), world_size)
    return batch.select(parts[rank])
