"""FSDPBackend with LoRA (FSDPConfig.lora) on spawned gloo ranks: one rank (the plain
module, and FSDP2 on one rank) and two ranks (FSDP2 shards the adapters with their layer).
Only adapters change, the optimizer holds only their moments, the reference is the base
with adapters off, the merged export gives the adapted model's log-probs in a plain HF
model, and an adapter-only checkpoint resumes exactly and refuses a model without LoRA."""

import json
import math

import fsdp_lora_worker
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from fsdp_lora_worker import SPEC, merged_log_probs

from rl_core.distributed import free_port, init_distributed

CASES = {"plain_1": (1, {}), "fsdp_1": (1, {"fsdp_on_one_rank": True}), "fsdp_2": (2, {})}


@pytest.fixture(scope="module", params=list(CASES))
def run(request, tmp_path_factory):
    world_size, overrides = CASES[request.param]
    workdir = tmp_path_factory.mktemp(request.param)
    args = (world_size, free_port(), str(workdir), overrides)
    mp.spawn(fsdp_lora_worker.run, args=args, nprocs=world_size)
    return torch.load(workdir / "results.pt", weights_only=False), workdir


def test_only_adapters_train_and_the_optimizer_holds_only_them(run):
    results, _ = run
    # 2 layers x 7 targets x (A, B): all change (B leaves zero), nothing else does
    assert len(results["adapters"]) == 28
    assert results["changed"] == results["adapters"]
    hidden, inter, kv = 64, 128, 2 * 16  # kv heads x head_dim
    per_layer = SPEC.rank * (
        2 * (hidden + hidden)  # q, o
        + 2 * (hidden + kv)  # k, v
        + 3 * (hidden + inter)  # gate, up, down
    )
    assert results["num_adapter"] == 2 * per_layer
    assert results["num_adapter"] < results["num_params"] / 10
    assert results["optimizer_bytes"] == 2 * 4 * results["num_adapter"]  # fp32 exp_avg(_sq)
    assert results["gain"] > 0  # sum of advantage x log-prob change over the batch


def test_reference_is_the_base_and_merged_export_is_the_adapted_model(run):
    results, _ = run
    assert results["ref_unchanged"]
    batch = results["rank0_batch"]
    got = merged_log_probs(results["merged"], batch)
    torch.testing.assert_close(got, results["trained_lp"], atol=2e-5, rtol=1e-5)
    assert not any(".lora_" in name for name in results["merged"])


def test_peft_export_holds_only_the_adapters_and_rebuilds_the_merged_weights(run):
    """The PEFT directory an engine loads per sync: only the adapters (all ranks' shards
    gathered), and base + alpha / r * B @ A is the merged export, weight by weight."""
    from safetensors.torch import load_file

    results, workdir = run
    config = json.loads((workdir / "peft" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    tensors = load_file(workdir / "peft" / "adapter_model.safetensors")
    prefix = "base_model.model."
    assert sorted(tensors) == sorted(f"{prefix}{n}.weight" for n in results["adapters"])
    assert results["peft_bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert not (workdir / "peft.tmp").exists()
    for name in results["adapters"]:
        module, _, part = name.rpartition(".")
        if part != "lora_A":
            continue
        a = tensors[f"{prefix}{module}.lora_A.weight"]
        b = tensors[f"{prefix}{module}.lora_B.weight"]
        rebuilt = results["base"][f"{module}.weight"] + (SPEC.alpha / SPEC.rank) * b @ a
        torch.testing.assert_close(rebuilt, results["merged"][f"{module}.weight"])


def test_checkpoint_holds_adapters_and_refuses_a_model_without_lora(run):
    results, workdir = run
    ckpt = workdir / "ckpt"
    info = json.loads((ckpt / "adapter.json").read_text())
    assert info["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": list(SPEC.targets)}
    assert info["base"]["model_config"]["model_type"] == "qwen2"
    saved = dcp.FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    model_keys = sorted(k.removeprefix("model.") for k in saved if k.startswith("model."))
    assert model_keys == results["adapters"]  # no frozen weight (nor the tied lm_head)
    sizes = [math.prod(m.size) for m in saved.values() if getattr(m, "size", None)]
    assert sum(sizes) == 3 * results["num_adapter"]  # adapters and two moments, no base
    if results["world_size"] == 1:
        import torch.distributed as dist
        from fsdp_lora_worker import config

        from rl_fsdp import FSDPBackend

        dist_info = init_distributed(device="cpu")
        try:
            full = FSDPBackend(config(lora=None), dist_info=dist_info)
            with pytest.raises(ValueError, match="holds a LoRA adapter but the model has no"):
                full.load_checkpoint(ckpt)
        finally:
            dist.destroy_process_group()
