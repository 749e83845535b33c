"""Where a colocated rl-fsdp trainer's onload spends its host time (GPU only).

Builds the trainer on the Qwen2.5-0.5B shape in bf16 (float32 master weights, fused AdamW),
trains two steps, then per variant offloads and onloads six times, timing the onload call
on the host and the whole restore (side stream included), and prints a torch.profiler table
of one onload. Variants: as the trainer does it; without the offload's ``empty_cache`` (the
storages regrow from the allocator's cache: what regrowing them costs); with every optimizer
state tensor of one kind a view of one flat buffer (3 storages instead of ~870).

    python bench/onload_profile.py --out onload_profile.json
"""

import argparse
import json
import statistics
import time

import torch
from model_shapes import SHAPES
from train_batches import make_batch

from rl_fsdp import FSDPBackend, FSDPConfig
from rl_fsdp.offload import optimizer_state_tensors


def flatten_state(optimizer) -> None:
    """Every AdamW state tensor of one kind becomes a view of one flat buffer."""
    for key in ("exp_avg", "exp_avg_sq", "step"):
        tensors = [state[key] for state in optimizer.state.values()]
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device="cuda")
        at = 0
        for state, tensor in zip(optimizer.state.values(), tensors, strict=True):
            view = flat[at : at + tensor.numel()].view_as(tensor)
            view.copy_(tensor)
            state[key] = view
            at += tensor.numel()
    torch.cuda.synchronize()


def cycles(backend, batch, label: str, rounds: int = 6) -> dict:
    host, full = [], []
    for _ in range(rounds):
        backend.offload()
        torch.cuda.synchronize()
        start = time.perf_counter()
        backend.onload()
        returned = time.perf_counter()
        backend.onload_all()
        torch.cuda.synchronize()
        host.append(returned - start)
        full.append(time.perf_counter() - start)
    backend.offload()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        backend.onload_all()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
    print(f"{label}: onload call {statistics.median(host) * 1000:.1f} ms on the host, "
          f"{statistics.median(full) * 1000:.1f} ms with the side stream\n{table}", flush=True)  # fmt: skip
    backend.train_step(batch)  # it still trains
    return {"host_ms": statistics.median(host) * 1000, "full_ms": statistics.median(full) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args()
    config = FSDPConfig(
        model_config={"model_type": "qwen2", **SHAPES["0.5b"]},
        device="cuda",
        precision="bf16",
        lr=1e-6,
    )
    backend = FSDPBackend(config)
    batch = make_batch([512] * 8, backend.model_config.vocab_size, torch.Generator())
    batch.old_log_probs = backend.compute_log_probs(batch)
    for _ in range(2):
        backend.train_step(batch)
    state = list(optimizer_state_tensors(backend.optimizer))
    result = {"optimizer_state_tensors": len(state), "gpu": torch.cuda.get_device_name()}
    result["as_is"] = cycles(backend, batch, "as is")
    empty_cache = torch.cuda.empty_cache
    torch.cuda.empty_cache = lambda: None
    try:
        result["no_empty_cache"] = cycles(backend, batch, "no empty_cache")
    finally:
        torch.cuda.empty_cache = empty_cache
    flatten_state(backend.optimizer)
    result["flat_state"] = cycles(backend, batch, "flat optimizer state")
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
