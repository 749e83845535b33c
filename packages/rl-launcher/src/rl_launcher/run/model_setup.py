"""The starting model every component loads: one Hugging Face directory.

With ``model.path`` set it is used as is. Otherwise a tiny model is built from
``model.init_config`` (seeded) and saved with the tokenizer into ``<run_dir>/initial_model``,
so the trainer and the engines start from the very same weights.
"""

import json
from pathlib import Path
from typing import Any

INITIAL_MODEL = "initial_model"


def load_tokenizer(path: str | Path):
    """A transformers tokenizer from a directory holding tokenizer.json (or a full HF dir)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"tokenizer directory {str(path)!r} does not exist; set model.tokenizer_path"
        )
    return AutoTokenizer.from_pretrained(str(path))


def prepare_model(model_config, *, run_dir: str | Path, seed: int) -> tuple[Path, Any]:
    """``(HF directory, tokenizer)`` of the run's starting policy."""
    if model_config.path is not None:
        path = Path(model_config.path)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model.path={str(path)!r} has no config.json; give a local HF directory"
            )
        return path, load_tokenizer(model_config.tokenizer_path or path)
    if model_config.tokenizer_path is None:
        raise ValueError("model.path is null: set model.tokenizer_path to a tokenizer directory")
    tokenizer = load_tokenizer(model_config.tokenizer_path)
    target = Path(run_dir) / INITIAL_MODEL
    if not (target / "config.json").is_file():
        build_tiny_model(
            model_config.init_config, tokenizer, seed=seed, dtype=model_config.dtype
        ).save_pretrained(target)
        tokenizer.save_pretrained(target)
    return target, tokenizer


def build_tiny_model(init_config: dict[str, Any], tokenizer, *, seed: int, dtype: str = "float32"):
    """A causal LM of ``init_config`` (with ``model_type``), random weights from ``seed``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(init_config)
    if "model_type" not in fields:
        raise ValueError("model.init_config needs a model_type, e.g. qwen2")
    vocab = fields.setdefault("vocab_size", len(tokenizer))
    if vocab < len(tokenizer):
        raise ValueError(
            f"model.init_config.vocab_size={vocab} is smaller than the tokenizer's "
            f"{len(tokenizer)} tokens; raise it to at least {len(tokenizer)}"
        )
    for key in ("eos_token_id", "pad_token_id"):
        fields.setdefault(key, tokenizer.eos_token_id)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))


def model_summary(path: Path) -> str:
    config = json.loads((Path(path) / "config.json").read_text())
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    return ", ".join(f"{k}={config.get(k)}" for k in keys)
