"""Rollout routing replay (R3): the trainer/engine log-prob gap of an MoE model with and
without replaying the engine's expert choices, in one run on the same samples.

A small Qwen3-MoE-shaped model (random weights; 4 layers, 8 experts, top-2, hidden 64) is
served by the embedded engine in bfloat16, which samples responses and returns each
token's experts (``return_routed_experts``); the FSDP backend (one gloo rank, float32) then
computes the log-probs of the same tokens twice: routing on its own (the baseline) and
replaying the engine's routes (R3). The precision difference is what differs between a
bf16 engine and an fp32 trainer; near-tied router scores flip under it, and a flipped
expert changes the token's output (the experts' weights are scaled up so that they carry
the residual stream, as in a trained MoE: see save_model). Reports, over the response
tokens: mean and max |trainer - engine| log-prob with and without replay, and for each pass
the share of (token, layer) pairs whose expert set differs from the engine's (0 with replay).

    python bench/routing_replay.py                        # 32 samples x 48 new tokens
    python bench/routing_replay.py --engine-dtype float32  # control: no precision gap
"""

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

MOE_CONFIG = {
    "model_type": "qwen3_moe",
    "vocab_size": 320,  # rl_sglang.tiny's byte tokenizer
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 256,
}


EXPERT_SCALE = 5.0  # expert weights x this: see save_model


def save_model(directory: Path, seed: int, expert_scale: float = EXPERT_SCALE) -> None:
    """Random weights, the experts' scaled by ``expert_scale``: at the default init
    (std 0.02) a 64-wide expert adds about 5 % to the residual stream, so a flipped expert
    hardly shows; scaled, the experts carry the stream as a trained MoE's do."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(MOE_CONFIG)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp.experts." in name:
                param.mul_(expert_scale)
    model.save_pretrained(directory)


def rollout(
    model_dir: Path, *, dtype: str, num_prompts: int, group: int, new_tokens: int, seed: int
):
    """Samples (prompt + response, the engine's log-probs and routes) from the embedded engine."""
    from rl_core.routing import decode_routes
    from rl_core.types import Sample, SampleStatus
    from rl_sglang.engine.core import Engine, load_model

    model, _ = load_model(str(model_dir), dtype=dtype)
    from rl_sglang.tiny import byte_tokenizer

    engine = Engine(model, byte_tokenizer(), max_context=256, enable_return_routed_experts=True)
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, 300, (int(n),), generator=gen).tolist()
        for n in torch.randint(4, 24, (num_prompts,), generator=gen)
    ]
    params = {
        "max_new_tokens": new_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "n": group,
        "sampling_seed": seed,
    }

    async def generate():
        groups, _ = engine.make_requests(
            {
                "input_ids": prompts,
                "sampling_params": params,
                "return_logprob": True,
                "return_routed_experts": True,
            }
        )
        outs = await asyncio.gather(*(engine.run(g) for g in groups))
        return [o for out in outs for o in out]

    try:
        outputs = asyncio.run(generate())
    finally:
        engine.scheduler.stop()
    layers, top_k = MOE_CONFIG["num_hidden_layers"], MOE_CONFIG["num_experts_per_tok"]
    samples = []
    for index, out in enumerate(outputs):
        meta = out["meta_info"]
        samples.append(
            Sample(
                tokens=prompts[index // group] + out["output_ids"],
                response_length=len(out["output_ids"]),
                rollout_log_probs=[entry[0] for entry in meta["output_token_logprobs"]],
                routed_experts=decode_routes(
                    meta["routed_experts"], num_layers=layers, top_k=top_k
                ),
                status=SampleStatus.COMPLETED,
                index=index,
            )
        )
    return samples


def trainer_log_probs(model_dir: Path, batch, dist_info):
    """The FSDP backend's log-probs ``[N]`` of ``batch`` with its routes (R3) and without,
    and for each pass the share of (token, layer) whose experts differ from the engine's."""
    from rl_fsdp import FSDPBackend, FSDPConfig

    config = FSDPConfig(
        model_path=str(model_dir), device="cpu", log_prob_max_tokens=batch.num_tokens
    )
    backend = FSDPBackend(config, dist_info=dist_info)
    baseline, own = log_probs_and_experts(backend, replace(batch, routed_experts=None))
    replayed, used = log_probs_and_experts(backend, batch)
    given = batch.routed_experts.long().sort(-1).values
    recorded = given[:, 0, 0] >= 0  # rows the engine ran (not sequence ends)

    def differ(routes) -> float:
        return float((routes[recorded] != given[recorded]).any(-1).float().mean())

    return replayed, baseline, differ(own), differ(used)


def log_probs_and_experts(backend, batch):
    """``(log-probs [N], experts the routers used [N, L, K] sorted per row)`` of one pass."""
    from rl_core.routing import hf_moe_routers
    from rl_fsdp.forward import token_indices

    used = {}  # hooks run in order: these see a replayed router's output
    handles = [
        router.register_forward_hook(lambda m, a, out, i=i: used.__setitem__(i, out[2]))
        for i, router in hf_moe_routers(backend.model).items()
    ]
    try:
        log_probs = backend.compute_log_probs(batch)
    finally:
        for handle in handles:
            handle.remove()
    (seqs,) = backend.plan(batch, batch.num_tokens)  # the pass's one micro-batch
    experts = torch.empty(batch.num_tokens, len(used), MOE_CONFIG["num_experts_per_tok"])
    experts = experts.long()
    experts[token_indices(batch, seqs)] = torch.stack([used[i] for i in sorted(used)], dim=1)
    return log_probs, experts.sort(-1).values


def gap(log_probs, batch) -> dict[str, float]:
    mask = batch.loss_mask > 0
    diff = (log_probs - batch.rollout_log_probs)[mask].abs()
    return {"mean_abs": float(diff.mean()), "max_abs": float(diff.max())}


def measure(
    *,
    engine_dtype="bfloat16",
    num_prompts=8,
    group=4,
    new_tokens=48,
    seed=0,
    expert_scale=EXPERT_SCALE,
    work_dir=None,
):
    """One run: the gaps with and without replay on the same samples."""
    from rl_core.batch import batch_from_samples
    from rl_core.distributed import init_distributed

    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        model_dir = Path(tmp) / "model"
        save_model(model_dir, seed, expert_scale)
        start = time.perf_counter()
        samples = rollout(
            model_dir,
            dtype=engine_dtype,
            num_prompts=num_prompts,
            group=group,
            new_tokens=new_tokens,
            seed=seed,
        )
        batch = batch_from_samples(samples, [0.0] * len(samples))
        dist_info = init_distributed(device="cpu")
        try:
            replayed, baseline, differ, replayed_differ = trainer_log_probs(
                model_dir, batch, dist_info
            )
        finally:
            torch.distributed.destroy_process_group()
        seconds = time.perf_counter() - start
    with_r3, without = gap(replayed, batch), gap(baseline, batch)
    return {
        "figure": "trainer/engine log-prob gap, mean |delta| over response tokens, with R3",
        "with_r3": with_r3,
        "baseline_without_r3": without,
        "ratio_mean_abs": with_r3["mean_abs"] / max(without["mean_abs"], 1e-12),
        "own_routes_differ_frac": differ,
        "replayed_routes_differ_frac": replayed_differ,
        "engine_dtype": engine_dtype,
        "trainer_dtype": "float32",
        "model": {k: v for k, v in MOE_CONFIG.items() if k != "vocab_size"},
        "expert_weight_scale": expert_scale,
        "samples": len(samples),
        "response_tokens": int((batch.loss_mask > 0).sum()),
        "seconds": round(seconds, 1),
        "hardware": f"{platform.machine()} CPU, torch {torch.__version__}",
        "command": "python " + " ".join(sys.argv),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = measure(
        engine_dtype=args.engine_dtype,
        num_prompts=args.prompts,
        group=args.group,
        new_tokens=args.new_tokens,
        seed=args.seed,
    )
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
