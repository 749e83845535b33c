"""Mixed precision as Megatron does it: bf16 parameters, fp32 main gradients, fp32 masters.

With ``precision="bf16"`` the model's parameters are bfloat16, so every matmul, norm and
tensor/sequence-parallel collective runs in bf16 without autocast, while
- every parameter carries a float32 ``main_grad`` (same shape): when backward has
  accumulated a bf16 ``.grad``, a post-accumulate hook folds it into ``main_grad`` and
  frees it, so micro-batches (and later the DP/TP reductions and clipping) sum in fp32.
  The first gradient of a step is copied, not added: ``zero_grad`` only marks the buffers
  stale (no kernel) and :func:`finish_accumulation` zeroes the few that got no gradient;
- the optimizer steps float32 master copies whose ``.grad`` *is* ``main_grad``; after each
  step the masters are rounded back into the bf16 parameters.
With ``precision="fp32"`` none of this exists: ``.grad`` is the gradient and the optimizer
steps the parameters themselves.
"""

from collections.abc import Callable

import torch

PRECISIONS = ("fp32", "bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient to reduce, clip and step: the fp32 ``main_grad`` when there is one."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def _accumulate_main_grad(param: torch.Tensor) -> None:
    if param.main_grad_stale:  # first gradient of the step: overwrite, nothing to add to
        param.main_grad.copy_(param.grad)
        param.main_grad_stale = False
    else:
        param.main_grad.add_(param.grad)
    param.grad = None  # the bf16 gradient is freed as soon as it is folded in


def finish_accumulation(params) -> None:
    """Zero the main gradients no backward wrote since ``zero_grad`` (call before reading
    them: reductions, norm, step). A no-op for parameters without one (fp32)."""
    stale = [p for p in params if getattr(p, "main_grad_stale", False)]
    if stale:
        torch._foreach_zero_([p.main_grad for p in stale])
        for param in stale:
            param.main_grad_stale = False


class MasterWeightsOptimizer:
    """An optimizer (built by ``build(masters)``) on fp32 master copies of ``params``.

    Exposes what the backend uses of a torch optimizer: ``step``, ``zero_grad``,
    ``param_groups`` and ``optim`` (the wrapped optimizer, as ZeRO names its inner one)."""

    def __init__(self, params: list[torch.nn.Parameter], build: Callable):
        self.params = list(params)
        self.masters = []
        for param in self.params:
            param.main_grad = torch.zeros_like(param, dtype=torch.float32)
            param.main_grad_stale = False
            param.register_post_accumulate_grad_hook(_accumulate_main_grad)
            master = param.detach().to(torch.float32, copy=True).requires_grad_(True)
            master.grad = param.main_grad  # the optimizer reads the fp32 sum directly
            self.masters.append(master)
        self.optim = build(self.masters)

    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups

    @torch.no_grad()
    def step(self) -> None:
        """Step the masters, then round them into the bf16 parameters."""
        self.optim.step()
        torch._foreach_copy_(self.params, self.masters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Mark the main gradients stale: the next backward overwrites each one (no zeroing
        pass over the fp32 buffers; :func:`finish_accumulation` zeroes those it missed)."""
        del set_to_none
        for param in self.params:
            param.main_grad_stale = True
            param.grad = None

    @torch.no_grad()
    def load_masters(self, masters: list[torch.Tensor] | None = None) -> None:
        """Set the masters from saved fp32 tensors (``None``: from the current parameters)
        and the parameters from the masters."""
        sources = masters if masters is not None else self.params
        for master, source in zip(self.masters, sources, strict=True):
            master.copy_(source)
        torch._foreach_copy_(self.params, self.masters)

    def move_to(self, device: torch.device) -> None:
        """Masters and main gradients to ``device`` (the optimizer state moves separately)."""
        for param, master in zip(self.params, self.masters, strict=True):
            param.main_grad = param.main_grad.to(device, non_blocking=True)
            master.grad = None
            master.data = master.data.to(device, non_blocking=True)
            master.grad = param.main_grad


def make_mixed(params, build: Callable, precision: str):
    """``build(params)`` for fp32; a :class:`MasterWeightsOptimizer` around it for bf16."""
    if precision == "fp32":
        return build(params)
    return MasterWeightsOptimizer(params, build)
