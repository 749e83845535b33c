"""Single-process pieces: micro-batch plans, rank shards, process-group argument checks,
weight buckets of an unsharded model, FLOP counts."""

import pytest
import torch
from fsdp_tiny import CONFIGS, LENGTHS, plain_model, tokens_batch

from rl_core.distributed import init_distributed
from rl_fsdp import FSDPConfig, shard_for_rank
from rl_fsdp.attention import resolve_attention
from rl_fsdp.forward import micro_batch, plan_micro_batches, token_indices
from rl_fsdp.metrics import matmul_params, train_flops
from rl_fsdp.modeling import hf_config
from rl_fsdp.weights import iter_weight_buckets


def test_plan_respects_budget_and_pads_to_a_common_count():
    batch = tokens_batch()
    plan = plan_micro_batches(batch, 25)
    assert sorted(i for mb in plan for i in mb) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in mb) <= 25 for mb in plan)
    padded = plan_micro_batches(batch, 25, len(plan) + 2)
    assert padded[: len(plan)] == plan and padded[len(plan) :] == [[], []]
    with pytest.raises(ValueError, match="micro-batches"):
        plan_micro_batches(batch, 25, 1)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        plan_micro_batches(batch, 10)


def test_empty_micro_batch_is_a_masked_dummy():
    batch = tokens_batch()
    batch.advantages = torch.ones(batch.num_tokens)
    dummy = micro_batch(batch, [])
    assert dummy.num_tokens == 1 and dummy.loss_mask.sum() == 0
    assert dummy.advantages.shape == (1,) and dummy.returns is None
    assert token_indices(batch, [1]).tolist() == list(range(9, 26))


def test_rank_shards_cover_the_batch_once_and_keep_global_denominators():
    batch = tokens_batch().with_global_denominators()
    shards = [shard_for_rank(batch, rank, 3) for rank in range(3)]
    assert sum(s.num_tokens for s in shards) == batch.num_tokens
    sizes = [s.num_tokens for s in shards]
    assert max(sizes) - min(sizes) <= max(LENGTHS)
    assert all(s.global_num_tokens == batch.global_num_tokens for s in shards)


def test_init_distributed_checks_arguments_before_joining():
    with pytest.raises(ValueError, match="outside world_size"):
        init_distributed(device="cpu", rank=2, world_size=2, master_port=1234)
    with pytest.raises(ValueError, match="master_port"):
        init_distributed(device="cpu", rank=0, world_size=2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            init_distributed(device="cuda")


def test_resolve_attention_on_cpu():
    assert resolve_attention("auto", torch.device("cpu")) == "sdpa_grouped"
    assert resolve_attention("sdpa_per_doc", torch.device("cpu")) == "sdpa_per_doc"
    with pytest.raises(ValueError, match="cuda"):
        resolve_attention("flash_varlen", torch.device("cpu"))


def test_buckets_are_bounded_and_reassemble_the_state_dict():
    model = plain_model(CONFIGS["llama"])
    buckets = list(iter_weight_buckets(model, bucket_bytes=50_000))
    flat = [pair for bucket in buckets for pair in bucket]
    state = dict(model.named_parameters())
    assert [name for name, _ in flat] == list(state)
    assert all(torch.equal(t, state[name]) for name, t in flat)
    for bucket in buckets:
        assert len(bucket) == 1 or sum(t.numel() * 4 for _, t in bucket) <= 50_000
    half = list(iter_weight_buckets(model, bucket_bytes=1 << 30, dtype=torch.bfloat16))
    assert len(half) == 1 and all(t.dtype == torch.bfloat16 for _, t in half[0])


def test_model_path_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json"):
        hf_config(FSDPConfig(model_path=str(tmp_path)))


def test_flops_by_hand():
    cfg = plain_model(CONFIGS["qwen2"]).config
    # per layer: q,o 64x64 each; k,v 64x32 each; mlp 3 x 64x128; plus the 512x64 head.
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    assert matmul_params(cfg) == 2 * per_layer + 512 * 64
    flops = train_flops(cfg, num_tokens=10, attn_tokens_sq=100)
    assert flops == 6 * matmul_params(cfg) * 10 + 6 * 2 * 64 * 100
