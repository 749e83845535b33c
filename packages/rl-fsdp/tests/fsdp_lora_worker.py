"""What each spawned gloo rank runs in tests/test_fsdp_lora_backend.py: a LoRA actor's
train steps, reference, merged export and adapter-only checkpoint, checked on every rank
(an AssertionError fails the spawn, hence the test). Rank 0 saves ``results.pt``."""

import os
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_tiny import CONFIGS, padded_log_probs, plain_model, tokens_batch

from rl_core.distributed import init_distributed
from rl_core.objective import Objective
from rl_fsdp import FSDPBackend, FSDPConfig, LoRASpec, shard_for_rank
from rl_fsdp.lora import is_lora_name
from rl_fsdp.weights import full_tensor

SPEC = LoRASpec(rank=4, alpha=8)


def config(**overrides) -> FSDPConfig:
    base = FSDPConfig(
        model_config=CONFIGS["qwen2"],  # q/k/v biases and tied embeddings: the merge's cases
        device="cpu",
        lr=1e-2,
        lora=SPEC,
        objective=Objective(kl_coef=0.1),
        max_tokens_per_micro_batch=48,
    )
    return replace(base, **overrides)


def global_batch():
    batch = tokens_batch()
    batch.advantages = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(3))
    return batch.with_global_denominators()


def run(rank: int, world_size: int, port: int, workdir: str, overrides: dict) -> None:
    dist_info = init_distributed(
        device="cpu", rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port
    )
    try:
        results = checks(dist_info, Path(workdir), overrides)
        if rank == 0:
            torch.save(results, Path(workdir) / "results.pt")
    finally:
        dist.destroy_process_group()


def full_state(backend) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p).clone() for n, p in backend.model.named_parameters()}


def optimizer_state_bytes(backend) -> int:
    """Bytes of AdamW's moments over all ranks (each rank holds its shards')."""
    local = sum(
        (v.to_local() if hasattr(v, "to_local") else v).nbytes
        for state in backend.optimizer.state.values()
        for key, v in state.items()
        if key in ("exp_avg", "exp_avg_sq")
    )
    total = torch.tensor(local, dtype=torch.int64)
    dist.all_reduce(total)
    return int(total)


def checks(dist_info, workdir: Path, overrides: dict) -> dict:
    batch = global_batch()
    mine = shard_for_rank(batch, dist_info.rank, dist_info.world_size)
    backend = FSDPBackend(config(**overrides), dist_info=dist_info)
    assert backend.ref_model is None  # the base itself is the reference
    before = full_state(backend)
    num_adapter = sum(t.numel() for n, t in before.items() if is_lora_name(n))
    start_ref = backend.compute_log_probs(mine, model="ref")
    assert torch.equal(backend.compute_log_probs(mine), start_ref)  # B = 0: starts as the base
    losses = [backend.train_step(mine)["loss/total"] for _ in range(2)]  # on-policy: ratio 1
    after = full_state(backend)
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    adapters = sorted(n for n in before if is_lora_name(n))
    trained_lp = backend.compute_log_probs(mine)
    ref_lp = backend.compute_log_probs(mine, model="ref")
    merged = {n: t for bucket in backend.export_weights(bucket_bytes=40_000) for n, t in bucket}
    peft_bytes = backend.export_lora_adapter(workdir / "peft")
    backend.save_checkpoint(workdir / "ckpt")
    next_loss = backend.train_step(mine)["loss/total"]

    fresh = FSDPBackend(config(**overrides), dist_info=dist_info)
    assert torch.equal(fresh.compute_log_probs(mine), start_ref)  # nothing loaded yet
    fresh.load_checkpoint(workdir / "ckpt")
    assert torch.equal(fresh.compute_log_probs(mine), trained_lp)
    assert fresh.train_step(mine)["loss/total"] == next_loss  # optimizer state came back too
    gain = (mine.loss_mask * mine.advantages * (trained_lp - start_ref)).sum()
    dist.all_reduce(gain)  # the policy-gradient objective rose over the whole batch
    return {
        "gain": float(gain),
        "losses": losses,
        "changed": changed,
        "adapters": adapters,
        "num_adapter": num_adapter,
        "num_params": sum(t.numel() for t in before.values()),
        "optimizer_bytes": optimizer_state_bytes(backend),
        "ref_unchanged": torch.equal(ref_lp, start_ref),
        "trained_lp": trained_lp,
        "merged": merged,
        "base": {n: t for n, t in before.items() if not is_lora_name(n)},
        "peft_bytes": peft_bytes,
        "world_size": dist_info.world_size,
        "rank0_batch": mine,
    }


def merged_log_probs(merged: dict, batch) -> torch.Tensor:
    """Log-probs of a plain HF model (other seed: every weight must come from ``merged``)."""
    model = plain_model(CONFIGS["qwen2"], seed=7)
    assert set(merged) == {name for name, _ in model.named_parameters()}  # tied: once
    model.load_state_dict(merged, strict=False)
    with torch.no_grad():
        return padded_log_probs(model, batch)


os.environ.setdefault("OMP_NUM_THREADS", "1")
