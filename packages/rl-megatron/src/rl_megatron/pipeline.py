"""Pipeline parallel (pp > 1): 1F1B (default) or GPipe schedules over the backend's
micro-batches, on plain point-to-point send/recv (gloo on CPU, nccl on GPU).

Every stage gets the same micro-batches (like TP ranks) and the same model inputs of each
(``[B, T']``: this CP rank's zigzag part of the rows, padded to the EP group's common shape),
so every stage knows the shape of each activation it will receive, ``[T', B, h]``
(``T' / tp`` under sequence parallel), and only data travels. The first stage embeds the
tokens, each stage runs its layers on the hidden states received from the previous one and
sends its output on; the last stage turns its logits into the rl_core loss (which already
carries the step's global denominators).
A backward sends the gradient of the stage's input back.

- ``"gpipe"``: all forwards, then all backwards (every micro-batch's activations held).
- ``"1f1b"``: stage s of P runs ``min(P - s - 1, M)`` warm-up forwards, then alternates one
  forward and one backward (oldest micro-batch first), then the remaining backwards: at
  most ``P - s`` micro-batches' activations are held at once, whatever M.
An exchange with a neighbour in both directions goes lower stage first: it sends then
receives, the higher one receives then sends, so blocking send/recv never deadlock.

With virtual stages (vpp > 1) each stage holds several model chunks and
:func:`run_interleaved` hands them to megatron-core's interleaved 1F1B schedule (its own
p2p of one activation shape), with the same inputs and loss function.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rl_core.batch import TrainBatch

SCHEDULES = ("1f1b", "gpipe")
# (part, logits [N_held, V/tp], held [N_held]) -> (loss, metrics) on the last stage
StageLoss = Callable[[TrainBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]
# a part's (input_ids [B, T'], valid [B, T'] bool, held [N_held]): forward.model_inputs
ModelInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class _Stage:
    """This rank's place in the pipeline and what it needs to exchange activations."""

    model: torch.nn.Module
    parts: list[TrainBatch]
    inputs: list[ModelInputs]
    loss_fn: StageLoss
    first: bool
    last: bool
    prev: int
    next: int
    device: torch.device
    dtype: torch.dtype
    results: list[dict] = field(default_factory=list)
    held: int = 0  # micro-batches whose activations are kept for a backward
    peak_held: int = 0


def run_schedule(
    model,
    parts: list[TrainBatch],
    *,
    inputs: list[ModelInputs],
    loss_fn: StageLoss,
    forward_only: bool,
    schedule: str = "1f1b",
    stats: dict | None = None,
) -> list[dict]:
    """Forward (and backward unless ``forward_only``) of every part through all stages
    (``inputs``: each part's model inputs, the same on every stage); returns the last
    stage's per-part metrics (an empty list on other stages). ``stats`` (optional)
    receives ``peak_held``: the most micro-batches held at once on this stage."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} unknown; choose one of {SCHEDULES}")
    stage = _stage(model, parts, inputs, loss_fn)
    if forward_only:
        with torch.no_grad():
            for index in range(len(parts)):
                _send_forward(stage, _forward(stage, index, _recv_forward(stage, index))[1])
    elif schedule == "gpipe":
        _gpipe(stage)
    else:
        _one_forward_one_backward(stage)
    if stats is not None:
        stats["peak_held"] = stage.peak_held
    return stage.results


def run_interleaved(
    chunks: list,
    parts: list[TrainBatch],
    *,
    inputs: list[ModelInputs],
    loss_fn: StageLoss,
    forward_only: bool,
) -> list[dict]:
    """:func:`run_schedule` over this stage's model chunks (virtual stages, ``vpp > 1``)
    with megatron-core's interleaved 1F1B schedule; ``len(parts)`` must be a positive
    multiple of the pipeline size (megatron's micro-batch groups) and every part's inputs
    of one shape. Returns the last stage's
    per-part metrics in part order (an empty list on other stages)."""
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_with_interleaving,
    )

    def forward_step(indices, chunk):
        index = next(indices)  # each chunk runs the parts in order
        input_ids, valid, held = inputs[index]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        output = chunk(input_ids, positions.expand_as(input_ids), attention_mask=None)

        def loss(logits):
            # one "token": the loss already carries the step's global denominators
            value, metrics = loss_fn(parts[index], logits[valid], held)
            return value, torch.ones((), dtype=torch.int, device=value.device), metrics

        return output, loss

    from megatron.core import parallel_state as ps

    rows, width = inputs[0][0].shape  # every part's: megatron sends one activation shape
    return forward_backward_pipelining_with_interleaving(
        forward_step_func=forward_step,
        data_iterator=[iter(range(len(parts))) for _ in chunks],
        model=chunks,
        num_microbatches=len(parts),
        seq_length=width * ps.get_context_parallel_world_size(),  # megatron divides by cp
        micro_batch_size=rows,
        forward_only=forward_only,
    )


def chunk_key(index: int, name: str) -> str:
    """A name unique over a stage's model chunks: chunk 0's own, later ones prefixed (each
    chunk numbers its layers from 0)."""
    return name if index == 0 else f"chunk{index}.{name}"


def _stage(model, parts, inputs, loss_fn) -> _Stage:
    from megatron.core import parallel_state as ps

    return _Stage(
        model=model,
        parts=parts,
        inputs=inputs,
        loss_fn=loss_fn,
        first=ps.is_pipeline_first_stage(),
        last=ps.is_pipeline_last_stage(),
        prev=ps.get_pipeline_model_parallel_prev_rank(),
        next=ps.get_pipeline_model_parallel_next_rank(),
        device=next(model.parameters()).device,
        dtype=model.config.pipeline_dtype,  # the residual stream's dtype (bf16 or fp32)
    )


def _gpipe(stage: _Stage) -> None:
    saved = []
    for index in range(len(stage.parts)):
        received, output = _forward(stage, index, _recv_forward(stage, index))
        _send_forward(stage, output)
        saved.append((received, output))
    for received, output in reversed(saved):
        grad = None if stage.last else _recv(stage.next, output.shape, stage)
        _send_backward(stage, _backward(stage, received, output, grad))


def _one_forward_one_backward(stage: _Stage) -> None:
    from megatron.core import parallel_state as ps

    count = len(stage.parts)
    stages, rank = (
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
    )
    warmup = min(stages - rank - 1, count)
    saved = []
    for index in range(warmup):
        saved.append(_forward(stage, index, _recv_forward(stage, index)))
        _send_forward(stage, saved[-1][1])
    received = _recv_forward(stage, warmup) if warmup < count else None
    for index in range(warmup, count):
        saved.append(_forward(stage, index, received))
        output, oldest = saved[-1][1], saved.pop(0)
        grad = None  # of the oldest micro-batch's output, sent back by the next stage
        if not stage.last:
            grad = _exchange(stage, stage.next, output.detach(), oldest[1].shape, lower=True)
        input_grad = _backward(stage, *oldest, grad)
        if index + 1 < count and not stage.first:
            shape = _input_shape(stage, index + 1)
            received = _exchange(stage, stage.prev, input_grad, shape, lower=False)
            received.requires_grad_(True)
        else:
            _send_backward(stage, input_grad)
    for received_output in saved:  # cool-down: the warm-up micro-batches' backwards
        grad = _recv(stage.next, received_output[1].shape, stage)
        _send_backward(stage, _backward(stage, *received_output, grad))


def _forward(stage: _Stage, index: int, received):
    """``(received, output)``: output is the loss on the last stage, else the hidden
    states ``[T, B, h]`` to send on (kept for the backward unless in no-grad mode)."""
    part = stage.parts[index]
    input_ids, valid, held = stage.inputs[index]
    stage.model.set_input_tensor(received)
    positions = torch.arange(input_ids.shape[1], device=stage.device).expand_as(input_ids)
    output = stage.model(input_ids, positions, attention_mask=None)
    if stage.last:
        output, metrics = stage.loss_fn(part, output[valid], held)
        stage.results.append(metrics)
    if torch.is_grad_enabled():
        stage.held += 1
        stage.peak_held = max(stage.peak_held, stage.held)
    return received, output


def _backward(stage: _Stage, received, output, grad):
    """Backward of one micro-batch from its loss (last stage) or the gradient of its
    output; returns the gradient of the stage's input (None on the first stage)."""
    if stage.last:
        output.backward()
    else:
        torch.autograd.backward(output, grad.to(output.dtype))
    stage.held -= 1
    return None if received is None else received.grad


def _input_shape(stage: _Stage, index: int) -> tuple[int, int, int]:
    """``[T', B, h]`` of the hidden states micro-batch ``index`` enters this stage with."""
    rows, width = stage.inputs[index][0].shape
    config = stage.model.config
    if config.sequence_parallel:
        width //= config.tensor_model_parallel_size
    return width, rows, config.hidden_size


def _recv_forward(stage: _Stage, index: int):
    if stage.first:
        return None
    received = _recv(stage.prev, _input_shape(stage, index), stage)
    return received.requires_grad_(torch.is_grad_enabled())


def _send_forward(stage: _Stage, output) -> None:
    if not stage.last:
        dist.send(output.detach().contiguous(), stage.next)


def _send_backward(stage: _Stage, input_grad) -> None:
    if not stage.first:
        dist.send(input_grad.contiguous(), stage.prev)


def _recv(src: int, shape, stage: _Stage) -> torch.Tensor:
    tensor = torch.empty(tuple(shape), dtype=stage.dtype, device=stage.device)
    dist.recv(tensor, src)
    return tensor


def _exchange(stage: _Stage, peer: int, outgoing: torch.Tensor, shape, *, lower: bool):
    """Send ``outgoing`` to ``peer`` and receive a ``shape`` tensor from it: the ``lower``
    stage of the two sends first, the higher receives first (both sides agree)."""
    if lower:
        dist.send(outgoing.contiguous(), peer)
        return _recv(peer, shape, stage)
    received = _recv(peer, shape, stage)
    dist.send(outgoing.contiguous(), peer)
    return received


def broadcast_from_last_stage(value):
    """``value`` of the last pipeline stage, on every stage of this pipeline."""
    from megatron.core import parallel_state as ps

    box = [value]
    dist.broadcast_object_list(
        box,
        src=ps.get_pipeline_model_parallel_last_rank(),
        group=ps.get_pipeline_model_parallel_group(),
    )
    return box[0]
