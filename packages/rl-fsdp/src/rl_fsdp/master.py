"""One rank without FSDP: float32 master parameters, a low-precision copy to compute with.

FSDP2 on a world of one communicates nothing, yet every step it casts and copies each
parameter through its gather buffers, and each gradient through its reduce buffers: on
an H200 at 1.5B parameters about 27 ms of copy kernels and some 800 small launches per
step (``bench/train_fsdp.py --fsdp-on-one-rank --profile`` measures them).
:class:`MasterWeights` does the same arithmetic with four flat buffers, the way Megatron
keeps its parameter and gradient buffers:

- the module's parameters are views of one float32 buffer (what the optimizer,
  checkpoints and weight export see, as FSDP's sharded parameters were);
- a ``compute_dtype`` copy of that buffer, refreshed in one cast after each optimizer
  step (:meth:`refresh`);
- inside :meth:`computing` every parameter's ``data`` is its view of the copy and its
  ``grad`` a view of a flat gradient buffer of the same dtype, which autograd
  accumulates into in place;
- after each micro-batch's backward :meth:`accumulate` adds that buffer into a float32
  gradient buffer in one kernel (the sum FSDP's reduce made, in the same order), so a
  step's gradient is summed in float32 over micro-batches; the step's first pass is
  copied rather than added, so the float32 buffer is never zeroed;
- on leaving :meth:`computing` the parameters get their float32 data back and, after a
  backward, their float32 gradients.

With ``compute_dtype`` float32 (CPU runs) there is no copy: compute and master are one.
Offloaded (colocated turns), the float32 parameters and the compute copy travel to the
host (:meth:`stashed`); the gradient buffers are freed and rebuilt
(:meth:`free_gradients`, :meth:`restore_gradients`).
Every trainable parameter gets a gradient (zero where a step did not use it).
"""

from contextlib import contextmanager

import torch
from torch import nn


class MasterWeights:
    """The flat buffers of one model's parameters on ``device`` (see the module docstring);
    the model's parameters become views of the float32 one at construction."""

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype, device: torch.device):
        self.params = list(model.parameters())  # tied weights once
        self.master = _flatten(self.params, torch.float32, device)
        self.mixed = compute_dtype != torch.float32
        self.compute = self.master.to(compute_dtype) if self.mixed else self.master
        self.grads = torch.zeros_like(self.master)  # float32 sum over micro-batches
        self.pass_grads = torch.zeros_like(self.compute) if self.mixed else self.grads
        # each parameter's view of each buffer, made once: slicing them anew cost the
        # host ~3 ms per buffer and step at 340 parameters (storage resizes keep views valid)
        self.views = {name: list(_views(getattr(self, name), self.params)) for name in BUFFERS}
        self._point("master")
        self.active = False
        self.has_grads = False  # a backward was accumulated since zero_grads

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The buffers reset every step: the float32 gradient sum and, with a compute
        copy, the per-pass gradients."""
        return [self.grads] if self.pass_grads is self.grads else [self.grads, self.pass_grads]

    def stashed(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What an offload keeps, split by when it is needed back: what forward passes
        read (the compute copy) and what only the update reads (the float32 parameters;
        nothing when they are the compute copy)."""
        return [self.compute], [self.master] if self.mixed else []

    def compute_copies(self) -> dict[int, torch.Tensor]:
        """Each parameter's view of the compute copy, by ``id(parameter)`` (empty when the
        compute dtype is float32): the parameters' current values, cast, for a weight
        export in the compute dtype (the copy is refreshed whenever the parameters change:
        after each optimizer step, a checkpoint load; an offload keeps it as it was)."""
        if not self.mixed:
            return {}
        return {id(p): view for p, view in zip(self.params, self.views["compute"], strict=True)}

    def free_gradients(self) -> None:
        """Give the gradient buffers' device memory back (while offloaded): nothing in
        them needs keeping, so nothing is copied to the host."""
        for tensor in self.gradient_buffers():
            tensor.untyped_storage().resize_(0)

    def restore_gradients(self) -> None:
        """Regrow the gradient buffers: zero per-pass gradients, no step's sum held."""
        for tensor in self.gradient_buffers():
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        self.zero_grads()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the float32 parameters into the compute copy (after they changed)."""
        if self.mixed:
            self.compute.copy_(self.master)

    def zero_grads(self) -> None:
        """Forget the step's gradients: the float32 sum is overwritten by the next
        :meth:`accumulate`; the per-pass buffer, which autograd adds into, is zeroed."""
        self.pass_grads.zero_()
        self.has_grads = False

    @contextmanager
    def computing(self):
        """Within: parameters and gradients are views of the compute copy and of the
        per-pass gradient buffer (re-entrant: an inner use keeps the outer state)."""
        if self.active:
            yield
            return
        self._point("compute", "pass_grads")
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self._point("master", "grads" if self.has_grads else None)

    @torch.no_grad()
    def accumulate(self) -> None:
        """After a backward inside :meth:`computing`: add its gradients into the float32
        sum (copy them, for the step's first) and clear the per-pass buffer (one kernel
        each)."""
        if self.mixed:
            if self.has_grads:
                self.grads.add_(self.pass_grads)
            else:
                self.grads.copy_(self.pass_grads)
            self.pass_grads.zero_()
        self.has_grads = True

    def _point(self, data: str, grads: str | None = None) -> None:
        """Every parameter's ``data`` (and ``grad``) as its view of the named buffers."""
        grad_views = self.views[grads] if grads else [None] * len(self.params)
        for param, value, grad in zip(self.params, self.views[data], grad_views, strict=True):
            param.grad = None  # a grad must match its parameter's dtype when assigned
            param.data = value
            if grad is not None and param.requires_grad:
                param.grad = grad


BUFFERS = ("master", "compute", "grads", "pass_grads")


def _flatten(params: list[nn.Parameter], dtype: torch.dtype, device) -> torch.Tensor:
    flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
    for param, view in zip(params, _views(flat, params), strict=True):
        view.copy_(param.detach())
    return flat


def _views(flat: torch.Tensor, params: list[nn.Parameter]):
    """The slices of ``flat`` shaped like each of ``params``."""
    offset = 0
    for param in params:
        yield flat[offset : offset + param.numel()].view(param.shape)
        offset += param.numel()
