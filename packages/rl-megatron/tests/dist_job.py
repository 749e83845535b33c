"""The two-rank gloo job of test_two_ranks.py: one spawn checks TP=2, then DP=2.

Rank 0's results go back to the parent, which compares them with its own one-rank results
(multi_rank.spawn_gloo).
"""

import faults_job
import tiny
import torch
import torch.distributed as dist

from rl_core.objective import Objective

LENGTHS = [9, 14, 6, 11]
POLICY = dict(device="cpu", lr=1e-3, clip_grad=0.0, objective=Objective(entropy_coef=0.01))
SFT = Objective(mode="sft")
BF16_LAYOUTS = {
    "tp2+sp": {"tp": 2, "sequence_parallel": True},
    "pp2": {"pp": 2, "max_tokens_per_micro_batch": 28},
    "dp2": {},  # ZeRO-1 over the fp32 masters
}


def rank_checks(rank: int, dirs: dict, out_path: str) -> dict:
    """Every check of the two-rank job, in order (each rank runs all of them)."""
    results = {"tp2": {name: tp2_checks(dirs[name], out_path) for name in ("qwen2-tied", "qwen3")}}
    # Sequence parallel, and an MoE model with TP=2 (experts TP-sharded), which needs it.
    for name in ("qwen3", "qwen3-moe"):
        results["tp2"][f"{name}+sp"] = tp2_checks(dirs[name], out_path, sequence_parallel=True)
    results["reshard"] = resume_checks(dirs["qwen3"], out_path)
    results["critic_tp2_sp"] = critic_checks(dirs["qwen3"], tp=2)
    results["vocab_parallel"] = vocab_parallel_checks(rank)
    results["dp2"] = dp2_checks(dirs["qwen3"], rank, out_path)
    results["ep2"] = ep2_checks(dirs["qwen3-moe"], rank, out_path)
    results["cp2"] = cp2_checks(dirs["qwen3"])
    # each layer one graph, the key/value all-gather (and its backward) traced in it
    results["cp2_compiled"] = cp2_checks(dirs["qwen3"], compile_layers=True)
    # CP=2 x EP=2: the two CP ranks are also the EP group (each holds half the experts)
    from four_rank_job import layout_checks  # imported here: it imports this module

    results["cp2_ep2"] = layout_checks(dirs["qwen3-moe"], f"{out_path}.cp_ep", cp=2, ep=2)
    results["pp2"] = {name: pp2_checks(dirs[name]) for name in ("qwen2-tied", "qwen3")}
    # each stage's layer compiled whole (rl_megatron.compiled_layers); two micro-batch shapes
    results["pp2"]["qwen3+compiled"] = pp2_checks(dirs["qwen3"], compile_layers=True)
    results["pp2_schedules"] = pp_schedule_checks(dirs["qwen3"])
    results["pp2_resume"] = pp_resume_checks(dirs["qwen2-tied"], out_path)
    results["critic_pp2"] = critic_checks(dirs["qwen2-tied"], out_path, pp=2)  # untied head
    results["bf16"] = {name: bf16_checks(dirs["qwen3"], **kw) for name, kw in BF16_LAYOUTS.items()}
    results["nonfinite_dp2"] = {
        precision: faults_job.nonfinite_checks(dirs["qwen3"], rank, precision)
        for precision in ("fp32", "bf16")
    }
    results["vpp2"] = vpp_checks(dirs["qwen3-4layers"], out_path)
    results["vpp2_compiled"] = vpp_compiled_checks(dirs["qwen3-4layers"])
    return results


def tp2_checks(hf_path: str, out_path: str, sequence_parallel: bool = False) -> dict:
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    config = MegatronConfig(hf_path=hf_path, tp=2, sequence_parallel=sequence_parallel, **POLICY)
    backend = MegatronBackend(config)
    assert backend.model.config.sequence_parallel == sequence_parallel
    batch = tiny.random_batch(LENGTHS, seed=11)
    result = {"log_probs": backend.compute_log_probs(batch)}
    result["exported"] = dict(p for b in backend.export_weights(bucket_bytes=1 << 20) for p in b)
    result["metrics"] = backend.forward_backward(batch)
    result["grads"] = backend.hf_gradients()
    result["grad_norm"] = backend.grad_norm()
    backend.optimizer.zero_grad()
    ckpt = f"{out_path}.ckpt"
    backend.save_checkpoint(ckpt)
    saved = backend.compute_log_probs(batch)
    backend.train_step(batch)
    backend.load_checkpoint(ckpt)
    result["resumed_equal"] = torch.equal(backend.compute_log_probs(batch), saved)
    return result


def resume_checks(hf_path: str, out_path: str) -> dict:
    """TP=2: a step, a checkpoint, a second step; a fresh backend resumed from the
    checkpoint takes the same second step. The parent loads the checkpoint at TP=1."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    config = MegatronConfig(hf_path=hf_path, tp=2, **{**POLICY, "clip_grad": 1.0})
    first, second = (tiny.random_batch(LENGTHS, seed=s) for s in (7, 8))
    straight = MegatronBackend(config)
    straight.train_step(first)
    ckpt = f"{out_path}.reshard_ckpt"
    straight.save_checkpoint(ckpt)
    result = {"ckpt": ckpt, "expected": straight.train_step(second)}
    result["log_probs"] = straight.compute_log_probs(second)
    resumed = MegatronBackend(config)
    resumed.load_checkpoint(ckpt)
    result["resumed_step"] = resumed.step
    result["resumed_metrics"] = resumed.train_step(second)
    result["resumed_log_probs"] = resumed.compute_log_probs(second)
    return result


def vocab_parallel_checks(rank: int) -> dict:
    """Each rank holds half the columns of the same random logits (last 20 are padding)."""
    from megatron.core import parallel_state as ps

    from rl_megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy

    gen = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(37, 64, generator=gen)
    targets, up_lp, up_ent = (
        torch.randint(0, 44, (37,), generator=gen),
        torch.randn(37, generator=gen),
        torch.randn(37, generator=gen),
    )
    local = logits.chunk(2, dim=1)[rank].clone().requires_grad_()
    lp, ent = vocab_parallel_log_probs_and_entropy(
        local,
        targets,
        vocab_size=44,
        tp_group=ps.get_tensor_model_parallel_group(),
        temperature=0.7,
        chunk_size=8,
    )
    ((lp * up_lp).sum() + (ent * up_ent).sum()).backward()
    grads = [torch.empty_like(local.grad) for _ in range(2)]
    dist.all_gather(grads, local.grad, group=ps.get_tensor_model_parallel_group())
    return {"log_probs": lp.detach(), "entropy": ent.detach(), "grad": torch.cat(grads, dim=1)}


def dp2_checks(hf_path: str, rank: int, out_path: str) -> dict:
    from rl_megatron import optim
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    backend = MegatronBackend(MegatronConfig(hf_path=hf_path, tp=1, **POLICY))
    assert backend.layout.dp_size == 2
    full = tiny.random_batch(LENGTHS, seed=11)
    shard = full.select([0, 3] if rank == 0 else [1, 2])  # keeps the full batch's denominators
    result = {"metrics": backend.forward_backward(shard), "grads": backend.hf_gradients()}
    backend.optimizer.zero_grad()
    result["zero_shards"] = len(optim.local_optimizer(backend.optimizer).param_groups[0]["params"])
    backend.save_checkpoint(f"{out_path}.dp_ckpt")
    backend.train_step(shard)
    result["log_probs_after_step"] = backend.compute_log_probs(full)
    backend.load_checkpoint(f"{out_path}.dp_ckpt")
    backend.train_step(shard)
    result["resumed_equal"] = torch.equal(
        backend.compute_log_probs(full), result["log_probs_after_step"]
    )
    return result


def ep2_checks(hf_path: str, rank: int, out_path: str) -> dict:
    """EP=2 (and DP=2 for the dense weights): each rank holds 2 of the 4 experts."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    backend = MegatronBackend(MegatronConfig(hf_path=hf_path, tp=1, ep=2, **POLICY))
    assert backend.layout.ep_size == 2
    full = tiny.random_batch(LENGTHS, seed=11)
    result = {"log_probs": backend.compute_log_probs(full)}
    result["exported"] = dict(p for b in backend.export_weights(bucket_bytes=1 << 20) for p in b)
    # Uneven shards and a small budget: rank 0 runs 3 micro-batches, rank 1 one real and
    # two empty ones (EP ranks must take part in every forward).
    backend.config.max_tokens_per_micro_batch = 15
    shard = full.select([0, 1, 3] if rank == 0 else [2])
    result["metrics"] = backend.forward_backward(shard)
    result["grads"] = backend.hf_gradients()
    result["grad_norm"] = backend.grad_norm()
    backend.optimizer.zero_grad()
    backend.train_step(shard)  # AdamW state for the experts this rank holds
    backend.save_checkpoint(f"{out_path}.ep_ckpt")
    saved = backend.compute_log_probs(full)
    backend.train_step(shard)
    backend.load_checkpoint(f"{out_path}.ep_ckpt")
    result["resumed_equal"] = torch.equal(backend.compute_log_probs(full), saved)
    return result


def cp2_checks(hf_path: str, **options) -> dict:
    """CP=2: both ranks get the whole batch and each runs its zigzag half of every row;
    ``options``: MegatronConfig fields."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    backend = MegatronBackend(MegatronConfig(hf_path=hf_path, cp=2, **POLICY, **options))
    assert backend.layout.cp_size == 2
    batch = tiny.random_batch(LENGTHS, seed=11)
    result = {"log_probs": backend.compute_log_probs(batch)}
    result["compiled_layers"] = backend.compiled_layers
    result["metrics"] = backend.forward_backward(batch)
    result["grads"] = backend.hf_gradients()
    result["grad_norm"] = backend.grad_norm()
    return result


def critic_checks(hf_path: str, out_path: str | None = None, *, tp: int = 1, pp: int = 1) -> dict:
    """Critic values after one and two value-loss steps (sequence parallel when tp > 1;
    1F1B over two micro-batches when pp > 1) and the steps' value losses. The head starts
    at zero, so only the second step moves the layers below it. With ``out_path``: a
    checkpoint after step one, loaded after step two, retakes step two exactly."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    config = MegatronConfig(
        hf_path=hf_path,
        tp=tp,
        pp=pp,
        sequence_parallel=tp > 1,
        critic=True,
        device="cpu",
        lr=1e-2,
        clip_grad=0.0,
        max_tokens_per_micro_batch=28,
    )
    critic = MegatronBackend(config)
    batch = tiny.random_batch(LENGTHS, seed=12)
    batch.returns = torch.linspace(-1.0, 1.0, batch.num_tokens)
    losses = [critic.train_step(batch)["loss/value"]]
    result = {"values": critic.compute_values(batch)}
    if out_path is not None:
        critic.save_checkpoint(f"{out_path}.critic_ckpt")
    losses.append(critic.train_step(batch)["loss/value"])
    result.update(losses=losses, values_after_two=critic.compute_values(batch))
    if out_path is not None:
        critic.load_checkpoint(f"{out_path}.critic_ckpt")
        critic.train_step(batch)
        result["resumed_equal"] = torch.equal(
            critic.compute_values(batch), result["values_after_two"]
        )
    return result


def pp2_checks(hf_path: str, **options) -> dict:
    """PP=2: one layer per stage, 1F1B over two micro-batches; ``options``: MegatronConfig
    fields."""
    from rl_core.compiling import compile_report
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    config = MegatronConfig(
        hf_path=hf_path, pp=2, max_tokens_per_micro_batch=28, **POLICY, **options
    )
    backend = MegatronBackend(config)
    assert backend.layout.pp_size == 2 and len(backend.model.decoder.layers) == 1
    batch = tiny.random_batch(LENGTHS, seed=11)
    result = {"log_probs": backend.compute_log_probs(batch)}
    result["exported"] = dict(p for b in backend.export_weights(bucket_bytes=1 << 20) for p in b)
    result["metrics"] = backend.forward_backward(batch)
    result["grads"] = backend.hf_gradients()
    result["grad_norm"] = backend.grad_norm()
    backend.optimizer.zero_grad()
    backend.train_step(batch)
    result["log_probs_after_step"] = backend.compute_log_probs(batch)
    result["compiled_layers"] = backend.compiled_layers
    result["compile"] = compile_report() if backend.compiled_layers else {}
    return result


def pp_schedule_checks(hf_path: str) -> dict:
    """PP=2 over four micro-batches with each schedule: loss, gradients and the most
    micro-batches whose activations each stage held at once ([stage 0, stage 1])."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    config = MegatronConfig(hf_path=hf_path, pp=2, max_tokens_per_micro_batch=14, **POLICY)
    backend = MegatronBackend(config)
    batch = tiny.random_batch(LENGTHS, seed=11)
    assert len(backend._micro_batches(batch.seq_lengths())) == 4
    result = {}
    for schedule in ("gpipe", "1f1b"):
        backend.config.pp_schedule = schedule
        backend.optimizer.zero_grad()
        metrics = backend.forward_backward(batch)
        peaks = [None, None]
        dist.all_gather_object(peaks, backend.pipeline_stats["peak_held"])
        result[schedule] = {"metrics": metrics, "grads": backend.hf_gradients(), "peak": peaks}
    return result


def pp_resume_checks(hf_path: str, out_path: str) -> bool:
    """PP=2 with tied embeddings (a copy on each stage): step, save, step; load, step
    again: the same log-probs as the uninterrupted second step."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    backend = MegatronBackend(MegatronConfig(hf_path=hf_path, pp=2, **POLICY))
    batch = tiny.random_batch(LENGTHS, seed=11)
    backend.train_step(batch)
    backend.save_checkpoint(f"{out_path}.pp_ckpt")
    backend.train_step(batch)
    expected = backend.compute_log_probs(batch)
    backend.load_checkpoint(f"{out_path}.pp_ckpt")
    backend.train_step(batch)
    return torch.equal(backend.compute_log_probs(batch), expected)


def bf16_checks(hf_path: str, **layout) -> dict:
    """precision="bf16" (bf16 params, fp32 main grads and masters): log-probs, the SFT
    gradient, three SFT steps."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    config = MegatronConfig(
        hf_path=hf_path, precision="bf16", objective=SFT, device="cpu", lr=1e-3, **layout
    )
    backend = MegatronBackend(config)
    assert {p.dtype for p in backend.model.parameters()} == {torch.bfloat16}
    batch = tiny.random_batch(LENGTHS, seed=11)
    if backend.layout.dp_size == 2:  # each DP rank takes half the sequences
        rank = backend.layout.dp_rank
        batch = batch.with_global_denominators().select([rank, rank + 2])
    result = {"log_probs": backend.compute_log_probs(batch)}
    backend.forward_backward(batch)
    result["grads"] = backend.hf_gradients()
    backend.optimizer.zero_grad()
    result["losses"] = [backend.train_step(batch)["loss/sft"] for _ in range(3)]
    return result


def vpp_checks(hf_path: str, out_path: str) -> dict:
    """PP=2 with two model chunks per stage (megatron's interleaved 1F1B; layers 0 and 2
    on stage 0) on a four-layer model: three micro-batches (padded to four, a multiple of
    pp, with an empty one), log-probs, export, loss and gradients; a checkpoint that
    resumes exactly and also loads without virtual stages."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    virtual = {"virtual_pipeline_model_parallel_size": 2}
    config = MegatronConfig(
        hf_path=hf_path, pp=2, megatron=virtual, max_tokens_per_micro_batch=20, **POLICY
    )
    backend = MegatronBackend(config)
    numbers = [[layer.layer_number for layer in c.decoder.layers] for c in backend.chunks]
    batch = tiny.random_batch(LENGTHS, seed=11)
    result = {"layers": numbers, "micro_batches": len(backend._micro_batches(LENGTHS))}
    result["log_probs"] = backend.compute_log_probs(batch)
    result["exported"] = dict(p for b in backend.export_weights(bucket_bytes=1 << 20) for p in b)
    result["metrics"] = backend.forward_backward(batch)
    result["grads"] = backend.hf_gradients()
    result["grad_norm"] = backend.grad_norm()
    backend.optimizer.zero_grad()
    backend.train_step(batch)
    backend.save_checkpoint(f"{out_path}.vpp_ckpt")
    saved = backend.compute_log_probs(batch)
    backend.train_step(batch)
    expected = backend.compute_log_probs(batch)
    backend.load_checkpoint(f"{out_path}.vpp_ckpt")
    result["reloaded_equal"] = torch.equal(backend.compute_log_probs(batch), saved)
    backend.train_step(batch)
    result["resumed_equal"] = torch.equal(backend.compute_log_probs(batch), expected)
    plain = MegatronBackend(MegatronConfig(hf_path=hf_path, pp=2, **POLICY))
    plain.load_checkpoint(f"{out_path}.vpp_ckpt")
    result["loads_without_vpp"] = torch.equal(plain.compute_log_probs(batch), saved)
    return result


def vpp_compiled_checks(hf_path: str) -> dict:
    """:func:`vpp_checks`' layout with each chunk's layer compiled whole
    (rl_megatron.compiled_layers): log-probs, loss, gradients and grad norm."""
    from rl_megatron.backend import MegatronBackend
    from rl_megatron.config import MegatronConfig

    virtual = {"virtual_pipeline_model_parallel_size": 2}
    config = MegatronConfig(
        hf_path=hf_path,
        pp=2,
        megatron=virtual,
        max_tokens_per_micro_batch=20,
        compile_layers=True,
        **POLICY,
    )
    backend = MegatronBackend(config)
    batch = tiny.random_batch(LENGTHS, seed=11)
    result = {"compiled_layers": backend.compiled_layers}
    result["log_probs"] = backend.compute_log_probs(batch)
    result["metrics"] = backend.forward_backward(batch)
    result["grads"] = backend.hf_gradients()
    result["grad_norm"] = backend.grad_norm()
    return result
