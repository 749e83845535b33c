"""The backend's training state as a megatron-core sharded state dict
(:mod:`megatron.core.dist_checkpointing`), so that a checkpoint loads under another TP/PP
layout (megatron reshards every tensor by its global offsets).

Entries (tensors are ``ShardedTensor`` s, or factories, carrying their global place):
- ``model``: ``GPTModel.sharded_state_dict()`` with every parameter's tensor replaced by its
  fp32 weights (the fp32 master under ``precision="bf16"``), so checkpoints never round
  through bf16 and resume in either precision;
- ``optimizer``: AdamW's ``exp_avg`` / ``exp_avg_sq`` sharded like their parameters
  (megatron's ``make_sharded_optimizer_tensor``). Under ZeRO-1 a data-parallel rank holds
  only its own parameters' state and saves it as the one copy. AdamW's per-parameter
  ``step`` is the same number everywhere: saved once, with the hyperparameters;
- common values (written by rank 0): ``step`` and the CPU RNG state.

Shapes: a parameter's entry is its local shard; the checkpoint stores the global tensor.
"""

from dataclasses import replace

import torch

from rl_megatron import optim
from rl_megatron.pipeline import chunk_key


def _fp32_weights(backend) -> list[torch.Tensor]:
    """The fp32 tensor behind each of ``backend.params``: its master, or itself."""
    return list(getattr(backend.optimizer, "masters", backend.params))


def _with_data(sharded, data: torch.Tensor, key: str | None = None, zero_owned: bool = False):
    """``sharded`` (ShardedTensor or factory) describing ``data`` instead, under ``key``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    changes = {"data": data, "key": key or sharded.key}
    if isinstance(sharded, ShardedTensor):
        changes["dtype"] = data.dtype
    if zero_owned and isinstance(sharded.replica_id, tuple):  # the only copy of this
        changes["replica_id"] = (*sharded.replica_id[:-1], 0)  # state: replica 0 on any DP rank
    return replace(sharded, **changes)


def _main_replica(replica_id) -> bool:
    ids = replica_id if isinstance(replica_id, tuple) else (replica_id,)
    return not any(ids)


def _uses_zero(optimizer) -> bool:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    while not isinstance(optimizer, ZeroRedundancyOptimizer) and hasattr(optimizer, "optim"):
        optimizer = optimizer.optim
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def sharded_state(backend, *, for_load: bool = False) -> tuple[dict, dict]:
    """``(sharded state dict, targets)``: the state of ``backend``, and where each loaded
    tensor goes (``targets["model"][local key] = fp32 tensor``, ``targets["optimizer"]
    [index][slot] = state tensor``). ``for_load``: empty AdamW state is created first."""
    model_state = {  # megatron's keys are global (layer offsets of each chunk included)
        chunk_key(index, key): value
        for index, chunk in enumerate(backend.chunks)
        for key, value in chunk.sharded_state_dict().items()
    }
    fp32 = {id(p): w for p, w in zip(backend.params, _fp32_weights(backend), strict=True)}
    sharded_by_param, model_targets = {}, {}
    for key, value in model_state.items():
        weight = fp32.get(id(getattr(value, "data", None)))
        if weight is None:
            continue  # not a trained parameter (e.g. extra state objects)
        if id(value.data) not in sharded_by_param or _main_replica(value.replica_id):
            sharded_by_param[id(value.data)] = value  # a tied copy: prefer the main one
        model_state[key], model_targets[key] = _with_data(value, weight), weight
    optimizer_state, optimizer_targets = _optimizer_state(backend, sharded_by_param, for_load)
    state = {
        "model": model_state,
        "optimizer": optimizer_state,
        "step": backend.step,
        "cpu_rng": torch.get_rng_state(),
    }
    return state, {"model": model_targets, "optimizer": optimizer_targets}


def _optimizer_state(backend, sharded_by_param: dict, for_load: bool) -> tuple[dict, dict]:
    local = optim.local_optimizer(backend.optimizer)
    param_of = {id(w): p for p, w in zip(backend.params, _fp32_weights(backend), strict=True)}
    stepped = [t for group in local.param_groups for t in group["params"]]
    if for_load:
        _create_adam_state(local, stepped)
    zero = _uses_zero(backend.optimizer)
    sharded, targets, steps = {}, {}, []
    for index, tensor in enumerate(stepped):
        slots = local.state.get(tensor, {})
        steps += [float(slots["step"])] if "step" in slots else []
        model_sharded = sharded_by_param[id(param_of[id(tensor)])]
        targets[index] = {k: v for k, v in slots.items() if k != "step"}
        sharded[index] = {
            slot: _with_data(model_sharded, value, f"optimizer.{slot}.{model_sharded.key}", zero)
            for slot, value in targets[index].items()
        }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in local.param_groups]
    common = {"adam_step": max(steps, default=0.0), "param_groups": groups}
    return {"state": sharded, **common}, targets


def _create_adam_state(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor]) -> None:
    """Zero AdamW moments for tensors without state (a fresh optimizer), so a load has
    tensors to fill; ``step`` where torch keeps it (on the device when fused)."""
    on_device = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    for tensor in tensors:
        if tensor not in optimizer.state or not optimizer.state[tensor]:
            step_device = tensor.device if on_device else torch.device("cpu")
            optimizer.state[tensor] = {
                "step": torch.zeros((), dtype=torch.float32, device=step_device),
                "exp_avg": torch.zeros_like(tensor, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(tensor, memory_format=torch.preserve_format),
            }


@torch.no_grad()
def apply_loaded(backend, loaded: dict, targets: dict) -> None:
    """Copy what :func:`megatron.core.dist_checkpointing.load` returned into the backend
    (factories return new tensors, so every value is copied, in place or not)."""
    for key, weight in targets["model"].items():
        weight.copy_(loaded["model"][key])
    if hasattr(backend.optimizer, "load_masters"):  # bf16: masters loaded, round into params
        backend.optimizer.load_masters(_fp32_weights(backend))
    saved = loaded["optimizer"]
    for index, slots in targets["optimizer"].items():
        for slot, tensor in slots.items():
            tensor.copy_(saved["state"][index][slot])
    local = optim.local_optimizer(backend.optimizer)
    for state in local.state.values():
        if "step" in state:
            state["step"].fill_(saved["adam_step"])
    for group, hyper in zip(local.param_groups, saved["param_groups"], strict=True):
        group.update(hyper)
    backend.step = int(loaded["step"])
    torch.set_rng_state(loaded["cpu_rng"])
