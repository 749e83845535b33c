"""rl-fsdp: the FSDP2 training backend (rl_core.protocols.TrainingBackend) on Hugging Face
causal LMs, CPU (gloo, fp32) and GPU (nccl, bf16 mixed precision)."""

from importlib.metadata import PackageNotFoundError, version

from rl_fsdp.backend import FSDPBackend
from rl_fsdp.config import FSDPConfig
from rl_fsdp.critic import FSDPCritic
from rl_fsdp.distributed import shard_for_rank
from rl_fsdp.lora import LoRASpec

try:
    __version__ = version("rl-fsdp")
except PackageNotFoundError:
    __version__ = "0.0.0"

__all__ = [
    "FSDPBackend",
    "FSDPConfig",
    "FSDPCritic",
    "LoRASpec",
    "shard_for_rank",
]
