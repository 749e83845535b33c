"""The four-rank gloo job of test_four_ranks.py: pipeline stages combined with context, with
expert and with tensor parallelism (PP=2 x CP=2 on Qwen3, PP=2 x EP=2 on Qwen3-MoE, PP=2 x
TP=2 with sequence parallel on Qwen3), virtual stages with experts (PP=2 x vpp=2 x EP=2 on
a four-layer Qwen3-MoE), and PP=2 x EP=2 and PP=2 x TP=2 + SP on a four-layer DeepSeek-V3.

Global rank 0's results go back to the parent, which compares them with its own one-rank
results (multi_rank.spawn_gloo).
"""

import tiny
import torch
from dist_job import LENGTHS, POLICY

VIRTUAL = {"virtual_pipeline_model_parallel_size": 2}


def rank_checks(rank: int, dirs: dict, out_path: str) -> dict:
    """The six layouts, one after the other (each rank runs all of them)."""
    return {
        "pp2_cp2": layout_checks(dirs["qwen3"], f"{out_path}.cp", pp=2, cp=2),
        "pp2_ep2": layout_checks(dirs["qwen3-moe"], f"{out_path}.ep", pp=2, ep=2),
        "tp2_pp2": layout_checks(
            dirs["qwen3"], f"{out_path}.tp", pp=2, tp=2, sequence_parallel=True
        ),
        "pp2_vpp2_ep2": layout_checks(
            dirs["qwen3-moe-4layers"], f"{out_path}.vpp", pp=2, ep=2, megatron=VIRTUAL
        ),
        # DeepSeek-V3 (MLA, sigmoid router, shared experts); stage 0: the dense layer and
        # an MoE one
        "deepseek_pp2_ep2": layout_checks(
            dirs["deepseek_v3-4layers"], f"{out_path}.ds_ep", pp=2, ep=2
        ),
        "deepseek_tp2_pp2": layout_checks(
            dirs["deepseek_v3-4layers"], f"{out_path}.ds_tp", pp=2, tp=2, sequence_parallel=True
        ),
    }


def layout_checks(hf_path: str, ckpt: str, max_tokens_per_micro_batch: int = 28, **layout) -> dict:
    """Log-probs of the full batch, HF export, the loss and gradients of this pipeline's
    share (with EP: data parallel, uneven shards and micro-batch counts), the grad norm,
    and a distributed checkpoint that resumes bit-exactly."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    budget = max_tokens_per_micro_batch
    config = MegatronConfig(hf_path=hf_path, max_tokens_per_micro_batch=budget, **layout, **POLICY)
    backend = MegatronBackend(config)
    sizes = backend.layout
    sizes_wanted = tuple(layout.get(k, 1) for k in ("pp", "tp", "cp", "ep"))
    assert (sizes.pp_size, sizes.tp_size, sizes.cp_size, sizes.ep_size) == sizes_wanted
    assert sizes.vpp_size == config.vpp
    full = tiny.random_batch(LENGTHS, seed=11)
    result = {"chunks": len(backend.chunks), "log_probs": backend.compute_log_probs(full)}
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
