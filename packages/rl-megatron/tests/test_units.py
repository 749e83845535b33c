"""Pieces checked without a process group: vocab-parallel maths on one rank, batch layout,
weight layout, CP slicing, config validation."""

import pytest
import tiny
import torch

from rl_core.cp import zigzag_gather
from rl_core.logprobs import log_probs_and_entropy
from rl_core.objective import Objective, policy_objective
from rl_megatron.config import MegatronConfig
from rl_megatron.cp import cp_shard_batch, cp_token_index
from rl_megatron.forward import model_inputs, padded_micro_batches
from rl_megatron.layout import param_layout, qkv_rows
from rl_megatron.shape import model_shape
from rl_megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy


@pytest.mark.parametrize(("temperature", "chunk_size"), [(1.0, 1024), (0.6, 5)])
def test_single_rank_vocab_parallel_equals_rl_core(temperature, chunk_size):
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(23, 40, generator=gen)).requires_grad_()
    targets = torch.randint(0, 33, (23,), generator=gen)
    lp, ent = vocab_parallel_log_probs_and_entropy(
        logits, targets, vocab_size=33, temperature=temperature, chunk_size=chunk_size
    )
    real = logits.detach()[:, :33].clone().requires_grad_()
    ref_lp, ref_ent = log_probs_and_entropy(real, targets, temperature=temperature)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    up = torch.randn(2, 23, generator=gen)
    (lp @ up[0] + ent @ up[1]).backward()
    (ref_lp @ up[0] + ref_ent @ up[1]).backward()
    torch.testing.assert_close(logits.grad[:, :33], real.grad, atol=1e-5, rtol=1e-4)
    assert torch.equal(logits.grad[:, 33:], torch.zeros(23, 7))


def test_tp1_log_probs_use_rl_core_on_the_real_columns():
    """forward.log_probs_and_entropy at TP=1 (rl_core's kernel on the unpadded columns)
    equals the vocab-parallel path, values and gradients, padding columns getting none."""
    from rl_megatron.forward import log_probs_and_entropy as head

    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(19, 48, generator=gen)).requires_grad_()
    targets = torch.randint(0, 41, (19,), generator=gen)
    lp, ent = head(logits, targets, vocab_size=41, temperature=0.8, with_entropy=True)
    copy = logits.detach().clone().requires_grad_()
    ref_lp, ref_ent = vocab_parallel_log_probs_and_entropy(
        copy, targets, vocab_size=41, temperature=0.8, chunk_size=7
    )
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    (lp.sum() + 0.5 * ent.sum()).backward()
    (ref_lp.sum() + 0.5 * ref_ent.sum()).backward()
    torch.testing.assert_close(logits.grad, copy.grad, atol=1e-5, rtol=1e-4)
    assert not logits.grad[:, 41:].any()


def test_vocab_parallel_rejects_bad_arguments():
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs_and_entropy(
            torch.zeros(2, 3), torch.zeros(2), vocab_size=3, temperature=0
        )


def test_model_inputs_right_pad_to_the_tp_multiple():
    tokens = torch.tensor([5, 6, 7, 8, 9])
    ids, valid, held = model_inputs(tokens, torch.tensor([0, 3, 5]), multiple=2)
    assert ids.tolist() == [[5, 6, 7, 0], [8, 9, 0, 0]]
    assert valid.tolist() == [[True, True, True, False], [True, True, False, False]]
    assert held.tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(ids[valid], tokens)  # packing back restores the order


def test_model_inputs_zigzag_split_for_context_parallel():
    # rows padded to 8 (a multiple of 2·cp = 4); chunks of 2; rank 1 holds chunks 1 and 2
    tokens = torch.arange(10, 19)  # sequences of 6 and 3 tokens
    ids, valid, held = model_inputs(
        tokens, torch.tensor([0, 6, 9]), multiple=4, cp_size=2, cp_rank=1
    )
    assert ids.tolist() == [[12, 13, 14, 15], [18, 0, 0, 0]]
    assert valid.tolist() == [[True, True, True, True], [True, False, False, False]]
    assert held.tolist() == [2, 3, 4, 5, 8]


def test_qkv_rows_follow_megatron_group_order():
    shape = model_shape(tiny.hf_config("qwen3"), tp_size=2)  # 4 heads, 2 groups, head_dim 16
    q_rows, kv_rows = qkv_rows(shape, 1)
    assert (q_rows.start, q_rows.stop) == (32, 64)  # heads 2 and 3
    assert (kv_rows.start, kv_rows.stop) == (16, 32)
    assert shape.padded_vocab_size == 512  # 500 padded to a multiple of 128·tp


def test_param_layout_maps_layers_and_rejects_unknown_names():
    layout = param_layout("decoder.layers.1.mlp.linear_fc1.weight", layer_offset=2)
    assert layout.kind == "gate_up"
    assert layout.hf_names == (
        "model.layers.3.mlp.gate_proj.weight",
        "model.layers.3.mlp.up_proj.weight",
    )
    with pytest.raises(ValueError, match="no HF mapping"):
        param_layout("decoder.layers.0.mystery.weight")


def test_model_shape_rejects_unsupported_models():
    config = tiny.hf_config("llama")
    config.model_type = "gpt2"
    with pytest.raises(ValueError, match="not supported"):
        model_shape(config)
    with pytest.raises(ValueError, match="tp=4"):
        model_shape(tiny.hf_config("llama"), tp_size=4)


def test_padded_micro_batches_bound_rows_times_longest():
    assert padded_micro_batches([4, 4, 3, 9, 1], 9) == [[3], [0, 1], [2, 4]]
    with pytest.raises(ValueError, match="sequence 3 has 9 tokens"):
        padded_micro_batches([4, 4, 3, 9, 1], 8)


def test_cp_index_hand_computed():
    # lengths 5 and 4 with cp_size 2: padded to 8 (chunks of 2) and 4 (chunks of 1);
    # rank 0 holds chunks 0 and 3 of each.
    index, positions, cu = cp_token_index(torch.tensor([0, 5, 9]), cp_size=2, cp_rank=0)
    assert positions.tolist() == [0, 1, 6, 7, 0, 3]
    assert index.tolist() == [0, 1, -1, -1, 5, 8]
    assert cu.tolist() == [0, 4, 6]


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum"])
def test_cp2_slices_sum_to_the_unsplit_loss(agg_mode):
    """Per-token maths on zigzag slices (logits of the full model at the held positions)."""
    batch = tiny.random_batch([9, 14, 6], seed=3)
    logits = 3 * torch.randn(batch.num_tokens, 50, generator=torch.Generator().manual_seed(1))
    batch.tokens = batch.tokens % 50

    def loss_of(part, part_logits, targets):
        lp, _ = vocab_parallel_log_probs_and_entropy(part_logits, targets, vocab_size=50)
        loss, _ = policy_objective(
            log_probs=lp,
            old_log_probs=part.old_log_probs,
            advantages=part.advantages,
            mask=part.loss_mask,
            agg_mode=agg_mode,
            cu_seqlens=part.cu_seqlens,
            num_tokens=part.global_num_tokens,
            num_seqs=part.global_num_seqs,
        )
        return loss, lp

    full_shard, full_targets, _ = cp_shard_batch(batch, cp_size=1, cp_rank=0)
    full_loss, full_lp = loss_of(full_shard, logits, full_targets)
    total, per_rank_lp = 0.0, []
    for rank in range(2):
        shard, targets, _ = cp_shard_batch(batch, cp_size=2, cp_rank=rank)
        index, _, _ = cp_token_index(batch.cu_seqlens, cp_size=2, cp_rank=rank)
        loss, lp = loss_of(shard, logits[index.clamp(min=0)], targets)
        total += float(loss)
        per_rank_lp.append(lp.masked_fill(index < 0, 0.0))
    assert total == pytest.approx(float(full_loss), abs=1e-6)
    first = zigzag_gather([lp[:6] for lp in per_rank_lp])  # sequence 0: 9 padded to 12
    torch.testing.assert_close(first, torch.cat([full_lp[:9], torch.zeros(3)]), atol=1e-6, rtol=0)


def test_config_is_validated(model_dirs):
    path = model_dirs["qwen3"][0]
    with pytest.raises(ValueError, match="config"):
        MegatronConfig(hf_path=path.parent)
    with pytest.raises(ValueError, match="objective must be an rl_core"):
        MegatronConfig(hf_path=path, objective={"kl_coef": 0.1})
    with pytest.raises(ValueError, match="tp must be positive"):
        MegatronConfig(hf_path=path, tp=0)
    with pytest.raises(ValueError, match="objective mode 'dpo': rl-megatron trains policy and sft"):
        MegatronConfig(hf_path=path, objective=Objective(mode="dpo"))
    with pytest.raises(ValueError, match="lr_decay='cosine' needs total_steps"):
        MegatronConfig(hf_path=path, lr_decay="cosine")
    with pytest.raises(ValueError, match="lr_decay must be one of constant, linear, cosine"):
        MegatronConfig(hf_path=path, lr_decay="step")


def test_config_reads_the_objective(model_dirs):
    """The reference defaults to the policy's own weights when the objective needs one
    (not for a critic); context parallelism refuses sequence-level terms by name."""
    path = model_dirs["qwen3"][0]
    with_kl, with_reward_kl = Objective(kl_coef=0.1), Objective(reward_kl_coef=0.1)
    assert MegatronConfig(hf_path=path, objective=with_kl).ref_path == path
    assert MegatronConfig(hf_path=path, objective=with_reward_kl).ref_path == path
    assert MegatronConfig(hf_path=path, objective=with_kl, critic=True).ref_path is None
    assert MegatronConfig(hf_path=path).ref_path is None
    sft, critic = Objective(mode="sft"), MegatronConfig(hf_path=path, critic=True)
    assert (MegatronConfig(hf_path=path, objective=sft).role, critic.role) == ("sft", "critic")
    with pytest.raises(ValueError, match="token-level policy_loss"):
        MegatronConfig(hf_path=path, cp=2, objective=Objective(policy_loss="gspo"))
    with pytest.raises(ValueError, match="rollout_is_level"):
        MegatronConfig(hf_path=path, cp=2, objective=Objective(rollout_is_level="sequence"))
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        MegatronConfig(hf_path=path, cp=2, objective=Objective(loss_agg_mode="seq-mean-token-mean"))
    token_level = Objective(policy_loss="cispo", rollout_is_level="token")
    assert MegatronConfig(hf_path=path, cp=2, objective=token_level).cp == 2
    assert MegatronConfig(hf_path=path, cp=2, ep=2).ep == 2  # CP x EP (test_two_ranks.py)
    for layout in ({"cp": 2}, {"ep": 2}, {"cp": 2, "critic": True}):  # pipeline combinations
        assert MegatronConfig(hf_path=path, pp=2, **layout).pp == 2


def test_modules_import_each_other_without_cycles():
    """Every ``rl_megatron`` import (top-level or inside a function) forms an acyclic graph:
    the model builder, the weight layout and the converters learn the shape from
    ``rl_megatron.shape`` rather than from each other."""
    import ast
    import graphlib
    from pathlib import Path

    import rl_megatron

    root = Path(rl_megatron.__file__).parent
    graph = {}
    for path in root.rglob("*.py"):
        module = ".".join(("rl_megatron", *path.relative_to(root).with_suffix("").parts))
        module = module.removesuffix(".__init__")
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            imported |= {n for n in names if n.startswith("rl_megatron")}
        graph[module] = imported
    modules = set(graph)
    graph = {m: {i for i in deps if i in modules and i != m} for m, deps in graph.items()}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle
