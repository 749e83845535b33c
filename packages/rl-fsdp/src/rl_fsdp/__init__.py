"""rl-fsdp: the FSDP2 training backend (rl_core.protocols.TrainingBackend) on Hugging Face
causal LMs, CPU (gloo, fp32) and GPU (nccl, bf16 mixed precision).

The names below load on first use: ``from rl_fsdp import FSDPConfig`` (what the launcher's
driver needs to describe a run) does not import the backend, torch.distributed.checkpoint
or the compiler stack, about 1.5 s of a CPU start-up; the training ranks import them."""

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rl-fsdp")
except PackageNotFoundError:
    __version__ = "0.0.0"

_HOMES = {
    "FSDPBackend": "rl_fsdp.backend",
    "FSDPConfig": "rl_fsdp.config",
    "FSDPCritic": "rl_fsdp.critic",
    "LoRASpec": "rl_fsdp.lora",
    "shard_for_rank": "rl_fsdp.distributed",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'rl_fsdp' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
