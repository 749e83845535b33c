"""Process groups: torch.distributed plus megatron-core's parallel_state (TP, PP, CP, EP, DP).

Every rank calls :func:`initialize_parallel` once with the same sizes; the data-parallel size
is what is left of the world: ``world = tp · pp · cp · dp``; expert parallelism (ep) splits
the data-parallel ranks.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """This rank's place in the layout (sizes and ranks of each parallel dimension)."""

    tp_size: int
    tp_rank: int
    pp_size: int
    vpp_size: int = 1  # model chunks per pipeline stage
    cp_size: int
    cp_rank: int
    dp_size: int
    dp_rank: int
    ep_size: int = 1
    ep_rank: int = 0
    etp_size: int = 1
    etp_rank: int = 0
    """Expert parallel, and the tensor parallel of expert weights (megatron: ETP = TP)."""


def initialize_parallel(
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    vpp: int = 1,
    seed: int = 1234,
    device: str = "cuda",
) -> ParallelLayout:
    """Create the process group (from the usual env vars when none exists) and megatron's
    groups (``vpp``: model chunks per pipeline stage). On CPU the caller must first install
    ``rl_megatron.testing.cpu_shim``."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(
            f"world size {world} is not divisible by tp·pp·cp = {tp}·{pp}·{cp}; "
            "change the parallel sizes or the number of ranks"
        )
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
    )
    _seed_rng(seed, device)
    return current_layout()


def current_layout() -> ParallelLayout:
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        vpp_size=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        cp_size=ps.get_context_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
    )


def _seed_rng(seed: int, device: str) -> None:
    torch.manual_seed(seed)
    if device == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
        return
    if torch.cuda.current_device() != "cpu":
        raise RuntimeError(
            "megatron-core on CPU needs the shim: call rl_megatron.testing.cpu_shim.install() "
            "before initialize_parallel(device='cpu')"
        )
    from rl_megatron.testing import cpu_shim

    cpu_shim.seed_cpu_rng_tracker(seed)
