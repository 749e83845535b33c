"""Compiled decoder layers compile in the first step and never again: steps of RL-loop-shaped
batches (a log-probs pass over the whole batch, then optimizer steps over round-robin
minibatches packed into micro-batches) whose token counts, sequence counts, longest
sequences and single-sequence micro-batches all vary from step to step. Before the fix a
colocated H100 run recompiled every layer's forward and backward at step 5 (7.8 s): the
token count was a backed dynamic size that inductor's heuristics guarded on, and the
longest sequence a static int until its first new value (rl_fsdp.fusion's docstring)."""

import functools
import logging

import pytest
import torch
from fsdp_tiny import CONFIGS
from varlen_cpu import register_cpu_kernels

from rl_core.batch import TrainBatch
from rl_core.packing import cu_seqlens_from_lengths
from rl_fsdp import FSDPBackend, fusion, modeling
from rl_fsdp.config import FSDPConfig

BUDGET = 120  # tokens per micro-batch: one to three per minibatch, some of one sequence
PROMPT = 4


@pytest.fixture(scope="module")
def world_of_one():
    import torch.distributed as dist

    from rl_core.distributed import init_distributed

    yield init_distributed(device="cpu")
    dist.destroy_process_group()


def loop_batch(step: int, gen: torch.Generator) -> TrainBatch:
    """One step's samples: 4-token prompts and responses of 1 to a step-dependent longest
    length (a tenth cut at it: packed longest first, some micro-batches hold only those),
    a step-dependent number of them; step 3 adds a sequence as long as the budget (a
    micro-batch of its own). Every sequence is at most 128 long: torch's varlen kernel
    choice branches there (the one graph a run on both sides of it adds)."""
    longest = (24, 40, 17, 33, 28)[step % 5]
    num = (48, 64, 29, 56, 40)[step % 5]
    responses = torch.randint(1, longest + 1, (num,), generator=gen)
    responses[torch.rand(num, generator=gen) < 0.1] = longest
    lengths = [PROMPT + int(r) for r in responses] + ([BUDGET] if step == 3 else [])
    cu = cu_seqlens_from_lengths(lengths)
    tokens = torch.randint(0, CONFIGS["qwen2"]["vocab_size"], (int(cu[-1]),), generator=gen)
    mask = torch.ones(tokens.shape[0])
    mask[cu[1:].long() - 1] = 0.0
    advantages = torch.randn(tokens.shape[0], generator=gen)
    return TrainBatch(tokens=tokens, cu_seqlens=cu, loss_mask=mask, advantages=advantages)


def minibatches(batch: TrainBatch, count: int) -> list[TrainBatch]:
    """The launcher's split: sequences dealt round-robin, denominators per minibatch."""
    return [
        batch.select(list(range(m, batch.num_seqs, count))).with_global_denominators()
        for m in range(count)
    ]


class RecompileLog(logging.Handler):
    """The recompile reasons dynamo logs (``torch._logging``'s "recompiles" artifact)."""

    def __init__(self):
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record):
        self.reasons.append(record.getMessage())


@pytest.fixture
def recompiles():
    handler = RecompileLog()
    logger = logging.getLogger("torch._dynamo.guards.__recompiles")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    torch._logging.set_logs()


def run_loop(world, impl: str, compile_blocks: bool, steps: int, recompiles=None):
    """Losses of ``steps`` loop steps, and the frames compiled and recompile reasons in
    each step (compiled layers with ``aot_eager``: dynamo's guards, no inductor codegen)."""
    from torch._dynamo.utils import counters

    config = FSDPConfig(
        model_config=CONFIGS["qwen2"],
        device="cpu",
        lr=1e-3,
        compile_blocks=compile_blocks,
        max_tokens_per_micro_batch=BUDGET,
    )
    backend = FSDPBackend(config, dist_info=world)
    backend.attention = impl  # torch_varlen: resolve_attention refuses it on CPU
    gen = torch.Generator().manual_seed(0)
    losses, frames, reasons = [], [], []
    for step in range(steps):
        before, logged = counters["frames"]["total"], len(recompiles.reasons if recompiles else [])
        batch = loop_batch(step, gen)
        batch.old_log_probs = backend.compute_log_probs(batch)
        losses += [backend.train_step(mb)["loss/total"] for mb in minibatches(batch, 4)]
        frames.append(counters["frames"]["total"] - before)
        reasons.append(recompiles.reasons[logged:] if recompiles else [])
    return losses, frames, reasons


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["torch_varlen", "sdpa_mask"])
def test_loop_steps_compile_once(world_of_one, impl, recompiles, monkeypatch):
    """Five loop steps: every frame is compiled in the first (the no-grad log-probs graph,
    then the training graph, of the layer and of the final norm) and none after it, with
    no graph break and nothing fallen back to eager; the losses equal eager ones."""
    from torch._dynamo.utils import counters

    register_cpu_kernels()
    compile_aot = functools.partial(fusion.compile_blocks, backend="aot_eager")
    monkeypatch.setattr(modeling, "compile_blocks", compile_aot)
    torch._dynamo.reset()
    counters.clear()
    failures = len(fusion.COMPILE_FAILURES)
    losses, frames, reasons = run_loop(world_of_one, impl, True, 5, recompiles)
    assert frames[0] == 4, reasons[0]  # (layer, norm) x (no grad, grad)
    assert frames[1:] == [0, 0, 0, 0], reasons
    assert dict(counters["graph_break"]) == {}
    assert len(fusion.COMPILE_FAILURES) == failures
    eager, _, _ = run_loop(world_of_one, impl, False, 5)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager), rtol=1e-4, atol=1e-6)


def test_the_varied_longest_sequence_is_dynamic_from_the_first_compile():
    """The longest sequence (a host int) is one of torch's dynamic sources once layers are
    compiled, whatever the user had listed there."""
    config = torch.compiler.config
    with config.patch(dynamic_sources="L['x']"):
        fusion.mark_ints_dynamic()
        fusion.mark_ints_dynamic()  # idempotent
        assert config.dynamic_sources.split(",") == ["L['x']", *fusion.DYNAMIC_INTS]
    assert fusion.inductor_options("aot_eager") is None
    assert fusion.inductor_options("inductor") == fusion.INDUCTOR_OPTIONS  # this torch has it


@pytest.mark.slow
def test_inductor_layers_compile_once_across_its_size_heuristics(world_of_one, recompiles):
    """The real compile (inductor's C++ backend, ``torch_varlen``'s op traced whole): steps
    of about 4,600, 2,300 and 6,900 tokens cross the token count that inductor's float-sum
    helper decides on (4,096; Triton's mix-order reduction decides on 5 * 2**20 / hidden
    the same way). A backed token dimension took a guard on it in the first step and
    recompiled layer and norm in the second; unbacked, nothing compiles after the first."""
    from torch._dynamo.utils import counters

    register_cpu_kernels()
    torch._dynamo.reset()
    counters.clear()
    config = FSDPConfig(
        model_config=CONFIGS["qwen2"],
        device="cpu",
        compile_blocks=True,
        max_tokens_per_micro_batch=8192,
    )
    backend = FSDPBackend(config, dist_info=world_of_one)
    backend.attention = "torch_varlen"
    gen = torch.Generator().manual_seed(1)
    frames = []
    for num in (40, 20, 60):
        before, logged = counters["frames"]["total"], len(recompiles.reasons)
        lengths = (PROMPT + torch.randint(90, 129 - PROMPT, (num,), generator=gen)).tolist()
        cu = cu_seqlens_from_lengths(lengths)
        tokens = torch.randint(0, CONFIGS["qwen2"]["vocab_size"], (int(cu[-1]),), generator=gen)
        batch = TrainBatch(tokens=tokens, cu_seqlens=cu, loss_mask=torch.ones(tokens.shape[0]))
        batch.advantages = torch.randn(tokens.shape[0], generator=gen)
        batch.old_log_probs = backend.compute_log_probs(batch)
        backend.train_step(batch.with_global_denominators())
        frames.append((counters["frames"]["total"] - before, recompiles.reasons[logged:]))
    assert frames[0][0] == 4 and [f for f, _ in frames[1:]] == [0, 0], frames
