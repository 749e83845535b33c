"""Weights and state of a :class:`rl_megatron.backend.MegatronBackend`: HF export for the
engines, atomic checkpoints, offload/onload for colocation.

The mixin expects the backend's attributes: ``config``, ``chunks`` (the model chunks),
``shape``, ``hf_config``, ``params``, ``optimizer``, ``step`` and ``device``.
"""

from collections.abc import Iterator
from pathlib import Path

import torch

from rl_megatron import checkpoint, dist_ckpt, export, optim


class WeightsAndStateMixin:
    """export_weights / export_hf / save_checkpoint / load_checkpoint / offload / onload."""

    def export_weights(self, *, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors in buckets of at most ``bucket_bytes`` (every rank gets all),
        on the model's device (the engines' transports take them from there)."""
        self._check_exportable()
        return export.hf_buckets(self.chunks, self.shape, bucket_bytes=bucket_bytes, on_device=True)

    def _check_exportable(self) -> None:
        if self.config.critic:
            raise ValueError("a critic (value head) has no HF causal-LM form to export")

    def hf_gradients(self) -> dict[str, torch.Tensor]:
        """Current gradients gathered into full HF-named tensors (for checks)."""
        return dict(export.hf_tensors(self.chunks, self.shape, grads=True))

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
            self.chunks, self.shape, self.hf_config, path, shard_bytes=bucket_bytes, dtype=dtype
        )

    def _meta(self) -> dict:
        """Checked on load: the mode. The layout (tp, pp, cp, ep) is recorded only: megatron
        reshards a distributed checkpoint into this run's layout."""
        layout = {"tp": self.config.tp, "pp": self.config.pp, "cp": self.config.cp}
        return {"mode": self.config.role, "saved_layout": {**layout, "ep": self.config.ep}}

    def save_checkpoint(self, path: Path) -> None:
        """Model (fp32 weights), AdamW state, step and RNG as a megatron distributed
        checkpoint (:mod:`rl_megatron.dist_ckpt`), atomic; all ranks call together."""
        state, _ = dist_ckpt.sharded_state(self)
        adam_state = bool(optim.local_optimizer(self.optimizer).state)  # False before a step
        checkpoint.save_distributed(path, state, {**self._meta(), "adam_state": adam_state})

    def load_checkpoint(self, path: Path) -> None:
        """Resume from :meth:`save_checkpoint`'s directory, saved under any TP/PP layout."""
        expected = {"mode": self.config.role}
        saved = checkpoint.distributed_meta(path, expected)  # refused before any change
        adam_state = saved.get("adam_state", False)
        if not adam_state:  # saved before the first step: no moments to load
            optim.local_optimizer(self.optimizer).state.clear()
        state, targets = dist_ckpt.sharded_state(self, for_load=adam_state)
        loaded = checkpoint.load_distributed(path, state, expected)
        dist_ckpt.apply_loaded(self, loaded, targets)

    def offload(self) -> None:
        """Parameters, gradients and optimizer state to host memory."""
        optim.move_training_state(self.params, self.optimizer, torch.device("cpu"))

    def onload(self) -> None:
        optim.move_training_state(self.params, self.optimizer, self.device)
