"""LoRA adapters out of the sharded model as a PEFT directory, what SGLang's
``/load_lora_adapter`` (and the embedded engine's) reads:

    adapter_config.json         peft_type LORA, r, lora_alpha, target_modules, base model
    adapter_model.safetensors   base_model.model.<module>.lora_A.weight [r, in], lora_B [out, r]

Only the adapters travel (a few MB where the merged model is the whole base), so a LoRA run
can keep the engines' base weights and swap adapters each sync.
"""

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rl_fsdp.lora import LoRASpec, lora_parameters
from rl_fsdp.weights import full_tensor

PEFT_PREFIX = "base_model.model."


def peft_adapter_tensors(model: nn.Module, dtype: torch.dtype | None = None):
    """``{peft name: full tensor}`` of every adapter (collective: each is gathered whole on
    every rank), cast to ``dtype`` when given."""
    tensors = {}
    for name, param in lora_parameters(model):
        tensor = full_tensor(param)
        tensors[f"{PEFT_PREFIX}{name}.weight"] = tensor if dtype is None else tensor.to(dtype)
    return tensors


def peft_config(spec: LoRASpec, base_model: str | None) -> dict:
    """The ``adapter_config.json`` of ``spec`` (plain LoRA: no bias, DoRA or rsLoRA)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": list(spec.targets),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }


def write_peft_adapter(
    model: nn.Module,
    spec: LoRASpec,
    path: Path,
    *,
    base_model: str | None = None,
    dtype: torch.dtype | None = None,
) -> int:
    """Write the adapters of ``model`` to ``path`` (collective; rank 0 writes
    ``<path>.tmp`` and renames it, so a reader never sees half a directory). Returns the
    bytes of the adapter tensors."""
    from safetensors.torch import save_file

    tensors = peft_adapter_tensors(model, dtype)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        host = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
        save_file(host, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(peft_config(spec, base_model)))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    return sum(t.numel() * t.element_size() for t in tensors.values())
