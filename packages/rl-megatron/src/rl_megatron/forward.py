"""One forward pass of a packed part of a :class:`rl_core.batch.TrainBatch` through a GPTModel.

The local layer spec has no varlen (THD) attention, so the packed sequences are laid out
padded, one per row, ``[B, T]`` with right padding: plain causal attention (SDPA's fused
kernels) is then exact for every real token, since a token never attends to positions after
it. T is rounded up to a multiple of ``multiple`` (tp, or 2·cp·tp with context parallel).
With cp > 1 each rank keeps its zigzag part of every row, ``[B, T / cp]``
(:func:`rl_core.cp.zigzag_slice`). The logits of the real tokens this rank holds are packed
back to ``[N_held, V/tp]``, together with their indices in the packed batch.

Shapes: tokens ``[N]``, cu_seqlens ``[B + 1]``; logits ``[N_held, V/tp]``; held ``[N_held]``.
"""

import contextlib

import torch

from rl_core.batch import next_token_targets
from rl_core.cp import zigzag_slice
from rl_core.packing import pad_packed
from rl_megatron.vocab_parallel import vocab_parallel_log_probs_and_entropy


def model_inputs(
    tokens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    multiple: int = 1,
    min_shape: tuple[int, int] = (0, 0),
    cp_size: int = 1,
    cp_rank: int = 0,
):
    """``(input_ids [B, T'], valid [B, T'] bool, held [N_held])``: right-padded rows (T a
    multiple of ``multiple``, at least ``min_shape``; extra rows are all padding), this CP
    rank's zigzag part of them (T' = T / cp_size), and the packed index of every real token
    kept, in row-major order."""
    padded, valid = pad_packed(tokens, cu_seqlens.to(tokens.device))
    rows, width = padded_shape(cu_seqlens, multiple)
    rows, width = max(rows, min_shape[0]), max(width, min_shape[1])
    extra_rows, extra_cols = rows - padded.shape[0], width - padded.shape[1]
    padded = torch.nn.functional.pad(padded, (0, extra_cols, 0, extra_rows))
    valid = torch.nn.functional.pad(valid, (0, extra_cols, 0, extra_rows))
    starts = torch.nn.functional.pad(cu_seqlens[:-1].to(tokens.device).long(), (0, extra_rows))
    index = starts[:, None] + torch.arange(width, device=tokens.device)[None, :]
    if cp_size > 1:
        padded, valid, index = (
            zigzag_slice(t, cp_size=cp_size, cp_rank=cp_rank, dim=1) for t in (padded, valid, index)
        )
    return padded, valid, index[valid]


def padded_shape(cu_seqlens: torch.Tensor, multiple: int = 1) -> tuple[int, int]:
    """``(rows, width)`` of the padded layout: one row per sequence, width rounded up."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    longest = int(lengths.max()) if lengths.numel() else 0
    return lengths.numel(), -(-longest // multiple) * multiple


def padded_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Sequence indices grouped so that each padded micro-batch, rows × longest row, stays
    within ``max_tokens``: longest first, so rows of similar length share a micro-batch and
    little compute goes to padding. A sequence longer than the budget raises ValueError."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for index in order:
        if lengths[index] > max_tokens:
            raise ValueError(
                f"sequence {index} has {lengths[index]} tokens, more than the micro-batch budget "
                f"max_tokens_per_micro_batch={max_tokens}; raise it or truncate the sequence"
            )
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def forward_logits(
    model, tokens: torch.Tensor, cu_seqlens: torch.Tensor, **layout
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [N_held, V/tp] (values [N_held, 1] for a critic), held [N_held])``;
    ``layout``: :func:`model_inputs`' keywords (multiple, min_shape, cp_size, cp_rank)."""
    input_ids, valid, held = model_inputs(tokens, cu_seqlens, **layout)
    positions = torch.arange(input_ids.shape[1], device=tokens.device).expand_as(input_ids)
    # Megatron derives rotary positions from the row length (and the CP rank); attention
    # mask None means causal.
    with _real_rows_only(model, valid) as selected:
        output = model(input_ids, positions, attention_mask=None)
    # squeeze, not output[0]: select's backward would write the [N_held, V] logits'
    # gradient into a zeroed [1, N_held, V] copy (1.2 ms a step on the 1.5B shape)
    return (output.squeeze(0) if selected else output[valid]), held


@contextlib.contextmanager
def _real_rows_only(model, valid: torch.Tensor):
    """While active, the LM head (or value head) gets only the hidden states of real
    tokens, ``[N_held, 1, h]``, instead of ``[T', B, h]``: no head matmul on padding and
    no ``[B, T', V]`` logits copied to select them (the model returns ``[1, N_held, V]``).
    Yields False (nothing done) under sequence parallel, where each TP rank holds part of
    the sequence until the head gathers it."""
    head = getattr(model, "output_layer", None)
    if head is None or model.config.sequence_parallel:
        yield False
        return

    def select(module, args):
        hidden, *rest = args  # [s, b, h] -> [N_held, 1, h], rows in (b, s) order as held
        return (hidden.transpose(0, 1)[valid].unsqueeze(1), *rest)

    handle = head.register_forward_pre_hook(select)
    try:
        yield True
    finally:
        handle.remove()


def log_probs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    tp_group=None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
):
    """Log-probs and entropy ``[N_held]`` of ``targets`` (the next tokens, from
    :func:`held_targets`). TP=1: rl_core's kernel (fused Triton on CUDA, chunked torch on
    CPU) on the real vocabulary columns; TP>1: the vocab-parallel softmax."""
    if _world(tp_group) == 1:
        from rl_core.logprobs import log_probs_and_entropy as full_vocab

        return full_vocab(
            logits[:, :vocab_size],  # a view: padding columns dropped, nothing copied
            targets,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
        )
    return vocab_parallel_log_probs_and_entropy(
        logits,
        targets,
        vocab_size=vocab_size,
        tp_group=tp_group,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
    )


def _world(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_initialized() and group is not None else 1


def held_targets(tokens: torch.Tensor, cu_seqlens: torch.Tensor, held: torch.Tensor):
    """Prediction-at-position targets ``[N_held]``: the next token of the full sequence (it
    may live on another CP rank); sequence ends predict token 0 (their loss mask is 0)."""
    return next_token_targets(tokens, cu_seqlens.to(tokens.device))[held]
