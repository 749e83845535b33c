"""The packed batches the training benches train on (bench/train_fsdp.py,
bench/train_megatron.py, bench/fsdp_scaling.py): the same lengths and tokens for the same
arguments and generator, built without importing either backend."""

import torch

from rl_core.batch import TrainBatch
from rl_core.packing import cu_seqlens_from_lengths


def lengths_for(args, gen: torch.Generator) -> list[int]:
    """full: num_seqs x max_len; varlen: uniform in [max_len / 32, max_len]."""
    if args.data == "full":
        return [args.max_len] * args.num_seqs
    low = max(args.max_len // 32, 2)
    return torch.randint(low, args.max_len + 1, (args.num_seqs,), generator=gen).tolist()


def make_batch(lengths: list[int], vocab: int, gen: torch.Generator) -> TrainBatch:
    """Random tokens packed by ``lengths``, each sequence's last token out of the loss, random
    advantages; global denominators set."""
    cu = cu_seqlens_from_lengths(lengths)
    tokens = torch.randint(0, vocab, (int(cu[-1]),), generator=gen)
    mask = torch.ones(tokens.shape[0])
    mask[cu[1:].long() - 1] = 0.0
    advantages = torch.randn(tokens.shape[0], generator=gen)
    batch = TrainBatch(tokens=tokens, cu_seqlens=cu, loss_mask=mask, advantages=advantages)
    return batch.with_global_denominators()


def loop_lengths(gen: torch.Generator, num: int, *, prompt: int, max_response: int) -> list[int]:
    """One RL step's sequence lengths: ``prompt`` + a response of 1..``max_response`` tokens,
    geometric about a mean that drifts between steps (8 % to 45 % of ``max_response``, as
    a policy's lengths do), a twentieth cut at ``max_response`` (truncated)."""
    mean = max_response * (0.08 + 0.37 * torch.rand((), generator=gen).item())
    steps = torch.empty(num).geometric_(1 / mean, generator=gen).long()
    responses = steps.clamp(1, max_response)
    responses[torch.rand(num, generator=gen) < 0.05] = max_response
    return [prompt + int(r) for r in responses]


def round_robin_minibatches(batch: TrainBatch, count: int) -> list[TrainBatch]:
    """rl-launcher's split of a step into optimizer steps: sequences dealt round-robin,
    loss denominators per minibatch."""
    picks = [list(range(m, batch.num_seqs, count)) for m in range(count)]
    return [batch.select(p).with_global_denominators() for p in picks if p]
