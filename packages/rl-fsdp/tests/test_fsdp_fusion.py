"""The GPU-step levers, checked on CPU against the plain path: compiled decoder layers
(rl_fsdp.fusion; one graph each with a traced attention, no graph break) give the eager
numbers and fall back to eager when compilation fails; the
single-rank FSDP settings (no reshard after forward, reduction in the compute dtype) give
the same parameters bit for bit as the ZeRO-3 / fp32-reduce settings."""

import copy
from dataclasses import replace

import pytest
import torch
from fsdp_tiny import CONFIGS, plain_model, tokens_batch

from rl_fsdp import fusion
from rl_fsdp.config import FSDPConfig
from rl_fsdp.modeling import (
    blocks_compiled,
    reduce_dtype,
    reshard_after_backward,
    reshard_after_forward,
)

MODEL = {"model_config": CONFIGS["qwen2"], "device": "cpu"}
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_lever_defaults_by_hand():
    cfg = FSDPConfig(**MODEL, precision="bf16")
    assert (reshard_after_forward(cfg, 1), reshard_after_forward(cfg, 2)) == (False, True)
    assert reshard_after_forward(replace(cfg, cpu_offload=True), 1) is True
    assert reshard_after_forward(replace(cfg, reshard_after_forward=True), 1) is True
    assert (reduce_dtype(cfg, 1), reduce_dtype(cfg, 2)) == (torch.bfloat16, torch.float32)
    assert reduce_dtype(replace(cfg, reduce_dtype="fp32"), 1) == torch.float32
    assert reduce_dtype(FSDPConfig(**MODEL), 1) == torch.float32
    assert (blocks_compiled(cfg, CPU), blocks_compiled(cfg, CUDA)) == (False, True)
    assert not blocks_compiled(replace(cfg, activation_checkpointing=True), CUDA)
    assert blocks_compiled(replace(cfg, compile_blocks=True), CPU)
    with pytest.raises(ValueError, match="compile_blocks"):
        FSDPConfig(**MODEL, compile_layers=True, compile_blocks=True)
    with pytest.raises(ValueError, match="reduce_dtype"):
        FSDPConfig(**MODEL, reduce_dtype="fp16")


def _logits_and_grads(model, lengths=(10, 23, 7)):
    """Logits of one forward per length and the parameter gradients of their sum."""
    logits = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(i))
        logits.append(model(input_ids=ids, use_cache=False).logits)
        logits[-1].sum().backward()
    return logits, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_compiled_blocks_equal_eager(family):
    """Every decoder layer wrapped whole, and the final norm; names unchanged, logits and
    gradients equal over three lengths (AOTAutograd tracing, forward and backward; HF's
    own SDPA attention, traced whole). Without the attention modules: every MLP and
    RMSNorm (qwen3: also q/k norms)."""
    eager = plain_model(CONFIGS[family])
    compiled = copy.deepcopy(eager)
    wrapped = fusion.compile_blocks(compiled, backend="aot_eager")
    layers = CONFIGS[family]["num_hidden_layers"]
    assert wrapped == layers + 1
    per_module = fusion.compile_units(copy.deepcopy(eager), attention=False)
    assert len(per_module) == layers * (5 if family == "qwen3" else 3) + 1
    assert fusion.compile_blocks(compiled, backend="aot_eager") == 0  # idempotent
    assert set(compiled.state_dict()) == set(eager.state_dict())
    got, got_grads = _logits_and_grads(compiled)
    expected, grads = _logits_and_grads(eager)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5)
    assert fusion.compiled_count(compiled) == (wrapped, 0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("impl", ["sdpa_mask", "sdpa_grouped", "sdpa_per_doc"])
def test_compiled_layers_around_packed_attention(family, impl, monkeypatch):
    """Packed attention inside compiled decoder layers: traced whole (sdpa_mask: one graph
    per layer, no graph break) or eager behind one graph break (the others); packed logits
    and gradients equal eager ones over four layouts, nothing fell back, and no graph was
    recompiled per layout (at most 6 graphs in all)."""
    monkeypatch.setattr("rl_fsdp.attention.PER_DOC_UP_TO", 0)  # sdpa_grouped groups even 2
    from torch._dynamo.utils import counters

    from rl_fsdp.attention import register_packed_attention
    from rl_fsdp.forward import packed_forward

    eager = plain_model(CONFIGS[family])
    eager.config._attn_implementation = register_packed_attention()
    compiled = copy.deepcopy(eager)
    wrapped = fusion.compile_blocks(compiled, backend="aot_eager")
    torch._dynamo.reset()  # count this test's graphs only (code is cached per code object)
    counters.clear()
    for lengths in ([9, 17, 5], [30, 2], [12, 12, 12, 4], [50]):
        batch = tokens_batch(lengths=lengths)
        logits = []
        for model in (compiled, eager):
            model.zero_grad()
            logits.append(packed_forward(model, batch.tokens, batch.cu_seqlens, impl))
            (logits[-1] * logits[-1].detach().sign()).sum().backward()
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
        for (name, got), expected in zip(
            compiled.named_parameters(), eager.parameters(), strict=True
        ):
            torch.testing.assert_close(got.grad, expected.grad, rtol=1e-4, atol=1e-4, msg=name)
    assert fusion.compiled_count(compiled) == (wrapped, 0)
    # layer (and after a break: the attention module and the layer, each static then
    # dynamic: Hugging Face hands them the input shape as Python ints), final norm
    assert counters["stats"]["unique_graphs"] <= 7
    breaks = sum(counters["graph_break"].values())
    assert (breaks == 0) == (impl == "sdpa_mask"), dict(counters["graph_break"])
    assert impl != "sdpa_mask" or counters["stats"]["unique_graphs"] == 2  # layer, norm


def test_failed_compilation_falls_back_to_eager():
    def broken_backend(graph_module, example_inputs):
        raise RuntimeError("lowering failed")

    eager = plain_model(CONFIGS["qwen2"])
    model = copy.deepcopy(eager)
    before = len(fusion.COMPILE_FAILURES)
    torch._dynamo.reset()
    wrapped = fusion.compile_blocks(model, backend=broken_backend)
    with pytest.warns(UserWarning, match="running eager"):
        got, _ = _logits_and_grads(model, lengths=(9,))
    expected, _ = _logits_and_grads(eager, lengths=(9,))
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    blocks = CONFIGS["qwen2"]["num_hidden_layers"] * 4  # each failed layer's, wrapped then
    assert fusion.compiled_count(model) == (0, wrapped + blocks)
    assert fusion.compiled_classes(model) == []
    assert "lowering failed" in fusion.COMPILE_FAILURES[before]
    assert len(fusion.COMPILE_FAILURES) - before == 4  # once per class, not per module


def test_a_layer_that_fails_whole_falls_back_to_its_blocks():
    """A backend that cannot lower attention (any graph with SDPA in it) fails the whole
    layers; each then runs its blocks compiled one by one: MLPs and norms compiled, the
    attention module (SDPA traced in it too) eager; logits equal eager ones."""

    def no_attention(graph_module, example_inputs):
        if "scaled_dot_product_attention" in graph_module.code:
            raise RuntimeError("cannot lower attention")
        return graph_module.forward

    eager = plain_model(CONFIGS["qwen2"])
    model = copy.deepcopy(eager)
    before = len(fusion.COMPILE_FAILURES)
    torch._dynamo.reset()
    fusion.compile_blocks(model, backend=no_attention)
    with pytest.warns(UserWarning, match="running eager"):
        got, _ = _logits_and_grads(model, lengths=(9, 14))
    expected, _ = _logits_and_grads(eager, lengths=(9, 14))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert fusion.compiled_classes(model) == ["Qwen2MLP", "Qwen2RMSNorm"]
    failed = [line.split(":")[0] for line in fusion.COMPILE_FAILURES[before:]]
    assert failed == ["Qwen2DecoderLayer", "Qwen2Attention"]


@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist

    from rl_core.distributed import init_distributed

    yield init_distributed(device="cpu")
    dist.destroy_process_group()


def _train(world_of_one, steps: int = 2, **overrides):
    """The backend, its losses and grad norms, and its full gradients after ``steps`` RL
    steps (bf16 unless overridden; 3 micro-batches per step)."""
    from rl_fsdp import FSDPBackend

    config = FSDPConfig(
        **MODEL, precision="bf16", lr=1e-2, max_tokens_per_micro_batch=48, fsdp_on_one_rank=True
    )
    backend = FSDPBackend(replace(config, **overrides), dist_info=world_of_one)
    batch = tokens_batch()
    batch.advantages = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(3))
    batch = batch.with_global_denominators()
    assert len(backend.plan(batch, 48)) == 3
    metrics = [backend.train_step(batch) for _ in range(steps)]
    losses = [(m["loss/total"], m["train/grad_norm"]) for m in metrics]
    grads = {k: p.grad.full_tensor() for k, p in backend.model.named_parameters()}
    return backend, losses, grads


def _full_params(backend) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() for k, v in backend.model.state_dict().items()}


def _assert_same_state(got, got_grads: dict, expected, expected_grads: dict) -> None:
    """Bit-identical full parameters and gradients of two backends."""
    got_params = _full_params(got)
    for name, value in _full_params(expected).items():
        assert torch.equal(got_params[name], value), name
    for name, value in expected_grads.items():
        assert torch.equal(got_grads[name], value), name


def test_single_rank_settings_are_bit_identical(world_of_one):
    """reshard_after_forward=False + bf16 reduction (the single-rank defaults) against
    ZeRO-3 resharding + fp32 reduction: the same losses, gradients and parameters, exactly."""
    fast, fast_losses, fast_grads = _train(world_of_one)
    slow, slow_losses, slow_grads = _train(
        world_of_one, reshard_after_forward=True, reduce_dtype="fp32"
    )
    assert fast_losses == slow_losses
    _assert_same_state(fast, fast_grads, slow, slow_grads)


def _count_gathers(monkeypatch) -> list[int]:
    """Counts the FSDP parameter-group unshards that do work (all-gather + cast)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    calls, unshard = [0], FSDPParamGroup.unshard

    def counted(self, *args, **kwargs):
        calls[0] += not self.is_unsharded and self._all_gather_result is None
        return unshard(self, *args, **kwargs)

    monkeypatch.setattr(FSDPParamGroup, "unshard", counted)
    return calls


def test_layers_stay_gathered_through_a_steps_micro_batches(world_of_one, monkeypatch):
    """reshard_after_backward=False (the single-rank default): one gather per layer and
    step instead of one per micro-batch, every unit sharded after the step, and the same
    losses, gradients and parameters bit for bit as resharding after every backward."""
    from torch.distributed.tensor import DTensor

    cfg = FSDPConfig(**MODEL, precision="bf16")
    assert (reshard_after_backward(cfg, 1), reshard_after_backward(cfg, 2)) == (False, True)
    assert reshard_after_backward(replace(cfg, reshard_after_backward=True), 1) is True
    gathers = _count_gathers(monkeypatch)
    kept, kept_losses, kept_grads = _train(world_of_one)
    kept_gathers, gathers[0] = gathers[0], 0
    freed, freed_losses, freed_grads = _train(world_of_one, reshard_after_backward=True)
    units = CONFIGS["qwen2"]["num_hidden_layers"] + 1
    assert kept_gathers == 2 * units and gathers[0] == 2 * 3 * units  # 2 steps x 3 micro
    assert all(isinstance(p, DTensor) for p in kept.model.parameters())
    assert kept_losses == freed_losses
    _assert_same_state(kept, kept_grads, freed, freed_grads)


def test_log_probs_leave_every_layer_sharded_on_one_rank(world_of_one):
    """Without resharding after forward, a no-grad pass must still free every layer (the
    gathered copies would go stale after the next update and defeat offloading), and the
    following training step must see the updated weights."""
    from torch.distributed.tensor import DTensor

    backend, _, _ = _train(world_of_one, steps=1)
    batch = tokens_batch()
    first = backend.compute_log_probs(batch)
    assert all(isinstance(p, DTensor) for p in backend.model.parameters())
    batch.advantages = torch.ones(batch.num_tokens)
    backend.train_step(batch.with_global_denominators())
    assert all(isinstance(p, DTensor) for p in backend.model.parameters())
    assert not torch.equal(backend.compute_log_probs(batch), first)  # updated weights used


@pytest.mark.slow
def test_backend_with_inductor_compiled_blocks_matches_eager(world_of_one):
    """The real path: FSDP2 + inductor-compiled decoder layers (fp32 on CPU), one step over
    3 micro-batches of different lengths, against compile_blocks=False."""
    failures = len(fusion.COMPILE_FAILURES)
    compiled, got_losses, got_grads = _train(
        world_of_one, steps=1, precision="fp32", compile_blocks=True
    )
    assert fusion.compiled_count(compiled.model) == (2 + 1, 0)
    assert fusion.compiled_classes(compiled.model) == ["Qwen2DecoderLayer", "Qwen2RMSNorm"]
    assert len(fusion.COMPILE_FAILURES) == failures
    _, losses, grads = _train(world_of_one, steps=1, precision="fp32", compile_blocks=False)
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=1e-4, atol=0)
    for name, value in grads.items():
        torch.testing.assert_close(got_grads[name], value, rtol=1e-3, atol=1e-6)
