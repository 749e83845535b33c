"""Pipeline parallel (pp > 1): a GPipe schedule over the backend's micro-batches.

Every stage gets the same micro-batches (like TP ranks). Forward: the first stage embeds
the tokens, each stage runs its layers on the hidden states ``[T, B, h]`` received from the
previous one (shape first, then data) and sends its output on; the last stage turns its
logits into the rl_core loss (which already carries the step's global denominators).
Backward runs the micro-batches in reverse, each stage sending the gradient of its input
back. Plain point-to-point send/recv, so it runs on gloo (CPU) and nccl alike; megatron's
1F1B schedule would overlap stages but allocates on "cuda" unconditionally.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist

from rl_core.batch import TrainBatch
from rl_megatron.forward import model_inputs

# (part, logits [N_held, V/tp], held [N_held]) -> (loss, metrics) on the last stage
StageLoss = Callable[[TrainBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]


def run_schedule(
    model, parts: list[TrainBatch], *, multiple: int, loss_fn: StageLoss, forward_only: bool
) -> list[dict]:
    """Forward (and backward unless ``forward_only``) of every part through all stages;
    returns the last stage's per-part metrics (an empty list on other stages)."""
    from megatron.core import parallel_state as ps

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    device = next(model.parameters()).device
    dtype = model.config.pipeline_dtype  # the residual stream's dtype (bf16 or fp32)
    saved, results = [], []
    for part in parts:
        input_ids, valid, held = model_inputs(part.tokens, part.cu_seqlens, multiple=multiple)
        received = (
            None if first else _recv(ps.get_pipeline_model_parallel_prev_rank(), device, dtype)
        )
        if received is not None:
            received.requires_grad_(not forward_only)
        model.set_input_tensor(received)
        positions = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
        output = model(input_ids, positions, attention_mask=None)
        if last:
            loss, metrics = loss_fn(part, output[valid], held)
            results.append(metrics)
            output = loss
        else:
            _send(output.detach(), ps.get_pipeline_model_parallel_next_rank())
        saved.append((received, output))
    if not forward_only:
        _backward(saved, first, last, device, dtype)
    return results


def _backward(saved, first: bool, last: bool, device, dtype) -> None:
    from megatron.core import parallel_state as ps

    for received, output in reversed(saved):
        if last:
            output.backward()
        else:
            grad = _recv(ps.get_pipeline_model_parallel_next_rank(), device, dtype)
            torch.autograd.backward(output, grad.to(output.dtype))
        if not first:
            _send(received.grad, ps.get_pipeline_model_parallel_prev_rank())


def _send(tensor: torch.Tensor, dst: int) -> None:
    """Shape (as a 4-long int64 tensor: ndim, sizes), then the data (the model's dtype)."""
    shape = torch.tensor(
        [tensor.dim(), *tensor.shape, *[0] * (3 - tensor.dim())], device=tensor.device
    )
    dist.send(shape, dst)
    dist.send(tensor.contiguous(), dst)


def _recv(src: int, device, dtype: torch.dtype) -> torch.Tensor:
    shape = torch.empty(4, dtype=torch.long, device=device)
    dist.recv(shape, src)
    ndim = int(shape[0])
    tensor = torch.empty(shape[1 : 1 + ndim].tolist(), dtype=dtype, device=device)
    dist.recv(tensor, src)
    return tensor


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
