"""The GPU job of test_gpu.py: the bf16 backend (bf16 params, fp32 main grads and masters,
compiled layers) on ``world`` GPUs over nccl, with the two-GPU layouts tp (TP=2 + sequence
parallel), pp (PP=2) and cp (CP=2); on one GPU also with eager layers, and ``no_cudnn``:
SDPA without cuDNN's attention and widths bucketed to 64. One GPU layouts also record the
attention operators a training step runs (``attention_ops``)."""

import os

import tiny
import torch
import torch.distributed as dist

from rl_core.objective import Objective

LENGTHS = [33, 70, 17, 52]
LAYOUTS = {
    "single": {},
    "tp": {"tp": 2, "sequence_parallel": True},
    "pp": {"pp": 2},
    "cp": {"cp": 2},
    "no_cudnn": {"attention_backends": "no_cudnn", "width_bucket": 64},
}


def _steps(hf_path: str, **options):
    """The bf16 backend's log-probs, then three training steps' losses."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    config = MegatronConfig(
        hf_path=hf_path,
        device="cuda",
        precision="bf16",
        lr=1e-3,
        objective=Objective(mode="sft"),
        **options,
    )
    backend = MegatronBackend(config)
    assert {p.dtype for p in backend.model.parameters()} == {torch.bfloat16}
    batch = tiny.random_batch(LENGTHS, seed=21)
    result = {"log_probs": backend.compute_log_probs(batch).cpu()}
    result["losses"] = [backend.train_step(batch)["loss/sft"] for _ in range(3)]
    return backend, result


def _attention_ops(backend) -> set[str]:
    """Names of the SDPA operators (aten::_scaled_dot_product_*) one training step runs,
    compiled layers included (inductor calls them as extern kernels)."""
    from torch.profiler import ProfilerActivity, profile

    batch = tiny.random_batch(LENGTHS, seed=22)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        backend.train_step(batch)
    return {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}


def run(rank: int, world: int, port: int, hf_path: str, out_path: str, layout: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    backend, result = _steps(hf_path, **LAYOUTS[layout])  # compiled layers: cuda's default
    exported = dict(p for b in backend.export_weights(bucket_bytes=1 << 20) for p in b)
    result["exported"] = exported
    result["compiled_layers"] = backend.compiled_layers
    if world == 1:
        from rl_core.compiling import compile_report

        result["compile"] = compile_report()
        result["attention_ops"] = _attention_ops(backend)
    if layout == "single":  # the same steps with eager layers
        result["eager"] = _steps(hf_path, compile_layers=False)[1]
    if rank == 0:
        torch.save(result, out_path)
    dist.destroy_process_group()
