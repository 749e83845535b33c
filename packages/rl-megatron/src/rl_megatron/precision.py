"""Mixed precision as Megatron does it: bf16 parameters, fp32 main gradients, fp32 masters.

With ``precision="bf16"`` the model's parameters are bfloat16, so every matmul, norm and
tensor/sequence-parallel collective runs in bf16 without autocast, while
- every parameter carries a float32 ``main_grad`` (same shape): when backward has
  accumulated a bf16 ``.grad``, a post-accumulate hook folds it into ``main_grad`` (on
  CUDA with a vectorised Triton kernel, :func:`fold_into_main_grad`) and frees it, so
  micro-batches (and later the DP/TP reductions and clipping) sum in fp32.
  The first gradient of a step is copied, not added: ``zero_grad`` only marks the buffers
  stale (no kernel) and :func:`finish_accumulation` zeroes the few that got no gradient;
- the optimizer steps float32 master copies whose ``.grad`` *is* ``main_grad``; after each
  step the masters are rounded back into the bf16 parameters.
With ``precision="fp32"`` none of this exists: ``.grad`` is the gradient and the optimizer
steps the parameters themselves.
"""

import functools
import importlib.util
from collections.abc import Callable

import torch

PRECISIONS = ("fp32", "bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient to reduce, clip and step: the fp32 ``main_grad`` when there is one."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def _accumulate_main_grad(param: torch.Tensor) -> None:
    # first gradient of the step (stale buffer): overwrite, nothing to add to
    fold_into_main_grad(param.main_grad, param.grad, accumulate=not param.main_grad_stale)
    param.main_grad_stale = False
    param.grad = None  # the bf16 gradient is freed as soon as it is folded in


def fold_into_main_grad(main: torch.Tensor, grad: torch.Tensor, *, accumulate: bool) -> None:
    """``main += grad`` (``accumulate``) or ``main = grad``, float32 ``main``: on CUDA a
    Triton kernel with wide loads (torch's cross-dtype copy and add do not vectorise;
    :mod:`rl_megatron._triton_fold`), elsewhere torch. The same values either way."""
    if _triton_folds(main, grad):
        from rl_megatron._triton_fold import fold

        fold(grad, main, accumulate=accumulate)
    elif accumulate:
        main.add_(grad)
    else:
        main.copy_(grad)


def _triton_folds(main: torch.Tensor, grad: torch.Tensor) -> bool:
    half = grad.dtype in (torch.bfloat16, torch.float16)
    contiguous = main.is_contiguous() and grad.is_contiguous()
    return main.is_cuda and grad.is_cuda and half and contiguous and _triton_installed()


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


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
