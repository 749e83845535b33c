"""FP8 checkpoints for rollout engines (block-wise e4m3, :mod:`rl_core.fp8`).

- :func:`write_fp8_checkpoint`: an HF directory converted the way DeepSeek-V3's checkpoints
  are laid out (quantised weights, their ``weight_scale_inv``, config.json's
  ``quantization_config``), written to a sibling and renamed, so a reader never sees half
  of one. SGLang starts from it with FP8 linear layers (``quantization: fp8``).
- :func:`is_fp8_checkpoint` / :func:`load_fp8_model`: the embedded engine's way in. It
  dequantises to its compute dtype at load (CPU has no FP8 matmuls), so its log-probs carry
  the FP8 rounding the SGLang engines have.
"""

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from rl_core.fp8 import dequantize_named, is_quantized_weight, quantization_config, quantize_named
from rl_sglang.engine.weights import copy_into_model


def is_fp8_checkpoint(path: str | Path) -> bool:
    """Whether the HF directory ``path`` holds block-wise FP8 weights."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    quant = json.loads(config.read_text()).get("quantization_config") or {}
    return quant.get("quant_method") == "fp8"


def write_fp8_checkpoint(source: str | Path, target: str | Path) -> Path:
    """``source`` (an HF safetensors directory) as an FP8 checkpoint in ``target``; other
    files (tokenizer, generation config) copied. A ``target`` already converted from the
    same source is kept as it is (a resumed run); otherwise replaced atomically."""
    from safetensors.torch import load_file, save_file

    source, target = Path(source), Path(target)
    stamp, stamp_file = _stamp(source), target / "fp8_source.json"
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return target
    staging = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    staging.mkdir(parents=True)
    kept = []
    for file in sorted(source.iterdir()):
        if file.suffix == ".safetensors":
            tensors = load_file(file)
            kept += [n.removesuffix(".weight") for n, t in tensors.items() if _kept(n, t)]
            quantized = {n: t.contiguous() for n, t in quantize_named(tensors.items())}
            save_file(quantized, staging / file.name, metadata={"format": "pt"})
        elif file.is_file() and file.name != "model.safetensors.index.json":
            shutil.copy2(file, staging / file.name)
    _write_index(staging)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(kept)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    (staging / "fp8_source.json").write_text(json.dumps(stamp))
    _replace(staging, target)
    return target


def _kept(name: str, tensor: torch.Tensor) -> bool:
    """A weight of a module that stays unquantised (listed in modules_to_not_convert)."""
    return name.endswith(".weight") and not is_quantized_weight(name, tensor.shape)


def _stamp(source: Path) -> dict:
    files = sorted(source.glob("*.safetensors"))
    return {
        "source": str(source.absolute()),
        "files": {f.name: f.stat().st_mtime_ns for f in files},
    }


def _write_index(directory: Path) -> None:
    from safetensors import safe_open

    weight_map = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            weight_map.update(dict.fromkeys(handle.keys(), file.name))
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _replace(staging: Path, target: Path) -> None:
    if target.exists():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
        shutil.rmtree(old)
    os.replace(staging, target)


def load_fp8_model(path: str | Path, dtype: torch.dtype | str = "auto"):
    """The causal LM of an FP8 checkpoint with its weights dequantised to ``dtype`` ("auto":
    the config's own dtype); transformers' own FP8 loading needs a GPU and accelerate."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    files = sorted(Path(path).glob("*.safetensors"))
    named = [item for file in files for item in load_file(file).items()]
    copy_into_model(model, dequantize_named(named, dtype))
    return model
