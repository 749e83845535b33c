"""Run megatron-core 0.16 on CPU (gloo): the only place that patches megatron or torch.cuda.

Used by the CPU tests, the CPU benchmark and ``rl-convert`` (conversions run on CPU),
never by the backend on GPUs. What it changes:

1. ``torch.cuda.current_device`` returns ``"cpu"``: megatron allocates its communication
   buffers, rotary frequencies and causal masks with ``device=torch.cuda.current_device()``.
2. megatron's RNG tracker (dropout / weight-init forks, normally CUDA generator states) is
   replaced by one that keeps CPU generator states, so ``get_cuda_rng_tracker().fork()``
   works and is deterministic per seed.
3. ``torch.cuda.synchronize`` is a no-op and ``Tensor.cuda()`` returns the tensor itself
   (pipeline p2p synchronises after each exchange; tied embeddings across pipeline stages
   move their copy with ``.cuda()`` before the initial all-reduce).
4. Under context parallel, megatron's rotary embeddings (plain and MLA's YaRN) pick this
   rank's zigzag chunks with an index tensor they pin and move with ``.cuda()``; the same
   selection is done on the embedding's own device instead.
5. Activation recompute (megatron's ``tensor_parallel.checkpoint``) saves and restores the
   CUDA generator's state with the CPU one and the tracker's: on CPU there is none, so the
   CUDA part reads as empty and setting it does nothing.
6. megatron's pipeline schedules allocate their token counter with ``device="cuda"``: their
   module's ``torch.zeros`` puts such tensors on the CPU.

Call :func:`install` once per process before building a model; it is idempotent.
"""

import contextlib

import torch

_INSTALLED = False


def install(seed: int = 1234) -> None:
    """Patch ``torch.cuda.current_device`` and install a CPU RNG tracker seeded with ``seed``."""
    global _INSTALLED
    if not _INSTALLED:
        from megatron.core.models.common.embeddings import (
            rotary_pos_embedding,
            yarn_rotary_pos_embedding,
        )

        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
        for module in (rotary_pos_embedding, yarn_rotary_pos_embedding):  # MLA's YaRN too
            module.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
        from megatron.core.tensor_parallel import random as mrandom

        mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
        mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
        from megatron.core.pipeline_parallel import schedules

        schedules.torch = _TorchOnCpu()
        _INSTALLED = True
    seed_cpu_rng_tracker(seed)


def seed_cpu_rng_tracker(seed: int) -> None:
    """Replace megatron's CUDA RNG tracker with :class:`CpuRNGStatesTracker` (default names)."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRNGStatesTracker()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Rows of chunks r and 2·cp-1-r of ``pos_emb`` along ``seq_dim`` (megatron's zigzag)."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
    picked = chunks.index_select(seq_dim, index)
    return picked.view(*picked.shape[:seq_dim], -1, *picked.shape[seq_dim + 2 :])


class _TorchOnCpu:
    """``torch`` for megatron's schedules module, with ``zeros(device="cuda")`` on the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


class CpuRNGStatesTracker:
    """Named CPU generator states with megatron's tracker interface (add / fork / states)."""

    def __init__(self):
        self.states_: dict[str, torch.Tensor] = {}

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_ = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        """Run the block on the named CPU stream, then restore the caller's CPU RNG state."""
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)
