"""The four-rank gloo job of test_four_ranks.py: pipeline stages combined with context, with
expert and with tensor parallelism (PP=2 x CP=2 on Qwen3, PP=2 x EP=2 on Qwen3-MoE, PP=2 x
TP=2 with sequence parallel on Qwen3).

Global rank 0 saves everything the parent compares against its own one-rank results.
"""

import os

import tiny
import torch
import torch.distributed as dist
from dist_job import LENGTHS, POLICY


def run(rank: int, world: int, port: int, dirs: dict, out_path: str) -> None:
    from rl_megatron.testing import cpu_shim

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cpu_shim.install()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {
        "pp2_cp2": layout_checks(dirs["qwen3"], f"{out_path}.cp", pp=2, cp=2),
        "pp2_ep2": layout_checks(dirs["qwen3-moe"], f"{out_path}.ep", pp=2, ep=2),
        "tp2_pp2": layout_checks(
            dirs["qwen3"], f"{out_path}.tp", pp=2, tp=2, sequence_parallel=True
        ),
    }
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


def layout_checks(hf_path: str, ckpt: str, **layout) -> dict:
    """Log-probs of the full batch, HF export, the loss and gradients of this pipeline's
    share (with EP: data parallel, uneven shards and micro-batch counts), the grad norm,
    and a distributed checkpoint that resumes bit-exactly."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    config = MegatronConfig(hf_path=hf_path, max_tokens_per_micro_batch=28, **layout, **POLICY)
    backend = MegatronBackend(config)
    sizes = backend.layout
    sizes_wanted = (2, *(layout.get(k, 1) for k in ("tp", "cp", "ep")))
    assert (sizes.pp_size, sizes.tp_size, sizes.cp_size, sizes.ep_size) == sizes_wanted
    full = tiny.random_batch(LENGTHS, seed=11)
    result = {"log_probs": backend.compute_log_probs(full)}
    result["exported"] = dict(p for b in backend.export_weights(bucket_bytes=1 << 20) for p in b)
    shard = full
    if sizes.dp_size == 2:  # EP splits the data-parallel ranks: rank 0 takes 3 sequences
        backend.config.max_tokens_per_micro_batch = 15  # 3 micro-batches; dp rank 1: 1 + 2 empty
        shard = full.select([0, 1, 3] if sizes.dp_rank == 0 else [2])
    result["micro_batches"] = len(backend._micro_batches(shard.seq_lengths()))
    result["metrics"] = backend.forward_backward(shard)
    result["grads"] = backend.hf_gradients()
    result["grad_norm"] = backend.grad_norm()
    backend.optimizer.zero_grad()
    backend.train_step(shard)
    backend.save_checkpoint(ckpt)
    saved = backend.compute_log_probs(full)
    backend.train_step(shard)
    expected = backend.compute_log_probs(full)
    backend.load_checkpoint(ckpt)
    result["reloaded_equal"] = torch.equal(backend.compute_log_probs(full), saved)
    backend.train_step(shard)
    result["resumed_equal"] = torch.equal(backend.compute_log_probs(full), expected)
    return result
