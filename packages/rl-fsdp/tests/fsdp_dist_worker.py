"""What each of the 2 spawned gloo ranks runs in the distributed tests; rank 0 saves the
results (``results.pt``) for the single-process reference checks in the test process.

One job checks several invariants, so the process group starts once per session.
"""

import dataclasses
import itertools
import os
from pathlib import Path

import torch
import torch.distributed as dist

from rl_core.distributed import init_distributed
from rl_core.protocols import TrainingBackend
from rl_fsdp import FSDPBackend, FSDPConfig, FSDPCritic, shard_for_rank
from rl_fsdp.weights import full_tensor


def run(rank: int, world_size: int, port: int, workdir: str) -> None:
    workdir = Path(workdir)
    spec = torch.load(workdir / "spec.pt", weights_only=False)
    if rank == 0:  # explicit arguments, as the Ray launcher starts ranks
        dist_info = init_distributed(
            device="cpu", rank=0, world_size=world_size, master_addr="127.0.0.1", master_port=port
        )
    else:  # torchrun-like environment variables
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        dist_info = init_distributed(device="cpu")
    try:
        results = _checks(spec, dist_info, workdir)
        if rank == 0:
            torch.save(results, workdir / "results.pt")
    finally:
        dist.destroy_process_group()


def _full_grads(model) -> dict[str, torch.Tensor]:
    return {name: full_tensor(p.grad) for name, p in model.named_parameters()}


def _checks(spec: dict, dist_info, workdir: Path) -> dict:
    batch = spec["batch"]
    local = shard_for_rank(batch, dist_info.rank, dist_info.world_size)
    backend = FSDPBackend(FSDPConfig(**spec["actor"]), dist_info=dist_info)
    out = {"local_seq_counts": _all_gather(local.num_seqs)}
    out["is_training_backend"] = isinstance(backend, TrainingBackend)
    out["log_probs"] = _gather_packed(backend.compute_log_probs(local), local)
    out["ref_log_probs"] = _gather_packed(backend.compute_log_probs(local, model="ref"), local)
    out["grads_by_budget"] = {}
    for budget in spec["budgets"]:
        backend.config.max_tokens_per_micro_batch = budget
        out["num_micro_batches", budget] = len(backend.plan(local, budget))
        backend.optimizer.zero_grad(set_to_none=True)
        metrics = backend.forward_backward(local)
        out["grads_by_budget"][budget] = (metrics, _full_grads(backend.model))
    backend.config.max_tokens_per_micro_batch = spec["budgets"][0]
    sft_objective = dataclasses.replace(backend.config.objective, mode="sft")
    sft = dataclasses.replace(backend.config, objective=sft_objective)
    backend.config, actor_config = sft, backend.config
    backend.optimizer.zero_grad(set_to_none=True)
    out["sft"] = (backend.forward_backward(local), _full_grads(backend.model))
    backend.config = actor_config
    out["buckets"] = [
        [(name, t.clone()) for name, t in bucket]
        for bucket in backend.export_weights(bucket_bytes=spec["bucket_bytes"])
    ]
    out.update(_train_and_resume(backend, local, workdir, spec["steps"]))
    out["critic"] = _critic(spec, dist_info, local)
    bf16 = dataclasses.replace(backend.config, precision="bf16", reference=False)
    out["log_probs_bf16"] = _gather_packed(
        FSDPBackend(bf16, dist_info=dist_info).compute_log_probs(local), local
    )
    return out


def _train_and_resume(backend, local, workdir: Path, steps: int) -> dict:
    first = [backend.train_step(local) for _ in range(steps)]
    backend.save_checkpoint(workdir / "ckpt")
    after = [backend.train_step(local) for _ in range(steps)]
    final = [(n, t.clone()) for b in backend.export_weights(bucket_bytes=1 << 30) for n, t in b]
    backend.export_hf(workdir / "hf", bucket_bytes=40_000)
    log_probs_final = _gather_packed(backend.compute_log_probs(local), local)
    from_dir = dataclasses.replace(
        backend.config, model_path=str(workdir / "hf"), model_config=None, reference=False
    )
    loaded = FSDPBackend(from_dir, dist_info=backend.dist)
    log_probs_loaded = _gather_packed(loaded.compute_log_probs(local), local)
    backend.offload()  # a no-op on CPU, but must leave the backend usable
    backend.onload()
    fresh = FSDPBackend(backend.config, dist_info=backend.dist)
    fresh.load_checkpoint(workdir / "ckpt")
    resumed_step = fresh.step
    resumed = [fresh.train_step(local) for _ in range(steps)]
    again = [(n, t.clone()) for b in fresh.export_weights(bucket_bytes=1 << 30) for n, t in b]
    return {
        "train_first": first,
        "train_after": after,
        "train_resumed": resumed,
        "resumed_step": resumed_step,
        "weights_final": dict(final),
        "weights_resumed": dict(again),
        "log_probs_final": log_probs_final,
        "log_probs_loaded": log_probs_loaded,
    }


def _critic(spec: dict, dist_info, local) -> dict:
    critic = FSDPCritic(FSDPConfig(**spec["critic"]), dist_info=dist_info)
    values = _gather_packed(critic.compute_values(local), local)
    metrics = critic.train_step(local)
    return {"values": values, "metrics": metrics}


def _all_gather(obj):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _gather_packed(values: torch.Tensor, local) -> dict[tuple, torch.Tensor]:
    """Per-sequence values of every rank keyed by the sequence's tokens (unique here)."""
    bounds = local.cu_seqlens.tolist()
    mine = {
        tuple(local.tokens[a:b].tolist()): values[a:b].detach().clone()
        for a, b in itertools.pairwise(bounds)
    }
    merged = {}
    for part in _all_gather(mine):
        merged.update(part)
    return merged
