"""Weights and state of a :class:`rl_megatron.backend.MegatronBackend`: HF export for the
engines, atomic checkpoints, offload/onload for colocation.

The mixin expects the backend's attributes: ``config``, ``model``, ``shape``,
``hf_config``, ``params``, ``optimizer``, ``step`` and ``device``.
"""

from collections.abc import Iterator
from pathlib import Path

import torch

from rl_megatron import checkpoint, export, optim


class WeightsAndStateMixin:
    """export_weights / export_hf / save_checkpoint / load_checkpoint / offload / onload."""

    def export_weights(self, *, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors in buckets of at most ``bucket_bytes`` (every rank gets all)."""
        self._check_exportable()
        return export.hf_buckets(self.model, self.shape, bucket_bytes=bucket_bytes)

    def _check_exportable(self) -> None:
        if self.config.mode == "critic":
            raise ValueError("a critic (value head) has no HF causal-LM form to export")

    def hf_gradients(self) -> dict[str, torch.Tensor]:
        """Current gradients gathered into full HF-named tensors (for checks)."""
        return dict(export.hf_tensors(self.model, self.shape, grads=True))

    def export_hf(
        self,
        path: str | Path,
        *,
        bucket_bytes: int = 4 << 30,
        dtype: torch.dtype | None = None,
    ) -> None:
        """The model as an HF safetensors directory, shards of at most ``bucket_bytes``
        (atomic; all ranks call, global rank 0 writes). Same call as rl-fsdp's."""
        self._check_exportable()
        export.save_hf_directory(
            self.model, self.shape, self.hf_config, path, shard_bytes=bucket_bytes, dtype=dtype
        )

    def _meta(self) -> dict:
        sizes = {
            "tp": self.config.tp,
            "pp": self.config.pp,
            "cp": self.config.cp,
            "ep": self.config.ep,
        }
        return {**sizes, "mode": self.config.mode}

    def save_checkpoint(self, path: Path) -> None:
        state = {
            "model": {n: p.detach().cpu() for n, p in self.model.named_parameters()},
            "optimizer": optim.local_optimizer(self.optimizer).state_dict(),
            "step": self.step,
            "cpu_rng": torch.get_rng_state(),
        }
        if hasattr(self.optimizer, "masters"):  # bf16: the fp32 master weights too
            state["masters"] = [m.detach().cpu() for m in self.optimizer.masters]
        checkpoint.save_sharded(path, state, self._meta())

    def load_checkpoint(self, path: Path) -> None:
        state = checkpoint.load_sharded(path, self._meta())
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in state["model"].items():
                params[name].copy_(tensor)
        self._load_fp32_weights(state)
        optim.local_optimizer(self.optimizer).load_state_dict(state["optimizer"])
        self.step = state["step"]
        torch.set_rng_state(state["cpu_rng"])

    def _load_fp32_weights(self, state: dict) -> None:
        """The exact fp32 weights whichever precision saved them: bf16 checkpoints carry
        fp32 masters, fp32 ones fp32 parameters."""
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        masters = state.get("masters") or [state["model"][n].float() for n in names]
        if hasattr(self.optimizer, "load_masters"):
            self.optimizer.load_masters(masters)
            return
        with torch.no_grad():
            for param, master in zip(self.params, masters, strict=True):
                param.copy_(master)

    def offload(self) -> None:
        """Parameters, gradients and optimizer state to host memory."""
        optim.move_training_state(self.params, self.optimizer, torch.device("cpu"))

    def onload(self) -> None:
        optim.move_training_state(self.params, self.optimizer, self.device)
