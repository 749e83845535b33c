"""The two-rank gloo job of test_families.py: GLM-4 at TP=2 and PP=2, DeepSeek-V3 at
TP=2 (sequence parallel, which megatron needs for MoE with TP) and EP=2, and a dense
DeepSeek-V3 (MLA only) at TP=2 without sequence parallel, in one spawn; and DeepSeek-V3
at PP=2 and PP=2 x vpp=2 (four layers, the first dense) and at CP=2 (plain rope and YaRN),
and GLM-4 at CP=2, through every check of a layout (four_rank_job.layout_checks: loss,
grad norm, resume).

Rank 0's results go back to the parent, which compares them with HF and its own one-rank
results (multi_rank.spawn_gloo).
"""

import tiny
from dist_job import LENGTHS, POLICY
from four_rank_job import layout_checks as full_layout_checks

LAYOUTS = {
    "glm4": {"tp2": {"tp": 2}, "pp2": {"pp": 2, "max_tokens_per_micro_batch": 28}},
    "deepseek_v3": {"tp2+sp": {"tp": 2, "sequence_parallel": True}, "ep2": {"ep": 2}},
    "deepseek_v3-dense": {"tp2": {"tp": 2}},
}
VIRTUAL = {"virtual_pipeline_model_parallel_size": 2}
FULL_LAYOUTS = {
    # pp2+vpp2: stage 0 holds layers 0 (dense) and 2 (MoE); 3 micro-batches run as 4
    "deepseek_v3-4layers": {
        "pp2": {"pp": 2},
        "pp2+vpp2": {"pp": 2, "megatron": VIRTUAL, "max_tokens_per_micro_batch": 20},
    },
    "deepseek_v3": {"cp2": {"cp": 2}},
    "deepseek_v3-yarn": {"cp2": {"cp": 2}},
    "glm4": {"cp2": {"cp": 2}},  # partial interleaved rope on zigzag chunks
}


def rank_checks(rank: int, dirs: dict, out_path: str) -> dict:
    """Every (family, layout) of LAYOUTS, then of FULL_LAYOUTS (each rank runs all)."""
    results = {
        (family, name): layout_checks(dirs[family], **layout)
        for family, layouts in LAYOUTS.items()
        for name, layout in layouts.items()
    }
    for family, layouts in FULL_LAYOUTS.items():
        for name, layout in layouts.items():
            ckpt = f"{out_path}.{family}.{name}"
            results[(family, name)] = full_layout_checks(dirs[family], ckpt, **layout)
    return results


def layout_checks(hf_path: str, **layout) -> dict:
    """Log-probs of the whole batch, the exported HF weights, and the gradient of one
    forward/backward under ``layout`` (with data-parallel replicas, EP's dense weights,
    each rank takes half the sequences with the whole batch's denominators)."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    backend = MegatronBackend(MegatronConfig(hf_path=hf_path, **layout, **POLICY))
    batch = tiny.random_batch(LENGTHS, seed=11)
    result = {"log_probs": backend.compute_log_probs(batch)}
    result["exported"] = dict(p for b in backend.export_weights(bucket_bytes=1 << 20) for p in b)
    if backend.layout.dp_size == 2:
        batch = batch.select([0, 3] if backend.layout.dp_rank == 0 else [1, 2])
    result["metrics"] = backend.forward_backward(batch)
    result["grads"] = backend.hf_gradients()
    return result
