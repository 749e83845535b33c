"""The FSDP2 actor: rl_core.protocols.TrainingBackend on a Hugging Face causal LM.

    backend = FSDPBackend(FSDPConfig(model_path="/models/qwen", lr=1e-6, reference=True))
    batch = shard_for_rank(global_batch, backend.dist.rank, backend.dist.world_size)
    batch.old_log_probs = backend.compute_log_probs(batch)
    batch.ref_log_probs = backend.compute_log_probs(batch, model="ref")
    metrics = backend.train_step(batch)
    for bucket in backend.export_weights(bucket_bytes=512 << 20): ...

All ranks call every method together with their own part of the batch.
"""

import copy
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from rl_core.aggregation import aggregate
from rl_core.batch import TrainBatch
from rl_core.importance import logprob_gap_share, rollout_importance_weights
from rl_core.kl import approx_kl
from rl_core.objective import policy_objective, sft_objective
from rl_fsdp.config import FSDPConfig
from rl_fsdp.distributed import DistInfo
from rl_fsdp.engine import ShardedTrainer
from rl_fsdp.forward import packed_log_probs
from rl_fsdp.modeling import (
    DTYPES,
    build_model,
    compute_params_only,
    freeze,
    is_fsdp,
    reshard_all,
    shard_model,
)
from rl_fsdp.weights import iter_weight_buckets, write_hf_dir

__all__ = ["FSDPBackend", "FSDPConfig"]


class FSDPBackend(ShardedTrainer):
    head = "causal_lm"

    def __init__(self, config: FSDPConfig, *, dist_info: DistInfo | None = None):
        super().__init__(config, dist_info=dist_info)
        self.ref_model = self._build_reference() if config.reference else None

    def _build_reference(self) -> torch.nn.Module:
        """A frozen, sharded copy of the initial weights (same source and seed)."""
        ref = freeze(shard_model(build_model(self.config), self.config, self.device))
        if not is_fsdp(ref):  # frozen: parameters in the compute dtype, no master copy
            compute_params_only(ref, self.device, DTYPES[self.config.precision])
        if self.config.ref_offload and self.device.type != "cpu":
            ref.to("cpu")
        return ref

    # --- log-probs ---------------------------------------------------------------------
    def compute_log_probs(self, batch: TrainBatch, *, model: str = "actor") -> torch.Tensor:
        """Log-probs ``[N]`` of the next tokens (0 at sequence ends), no graph built."""
        net = self._pick(model)
        self.onload()
        batch = batch.to(self.device)
        budget = self.config.micro_batch_tokens_for_log_probs

        def log_probs(mb: TrainBatch) -> torch.Tensor:
            return self._log_probs(net, mb, with_entropy=False, budget=budget)[0]

        compute = self.computing() if net is self.model else nullcontext()
        with torch.no_grad(), self._swapped_in(net), compute:
            out = self.per_token(batch, budget, log_probs)
            reshard_all(net)  # the root (and layers on one rank) stay gathered after forward
        out.index_fill_(0, batch.cu_seqlens[1:].long() - 1, 0.0)  # sequence ends
        return out

    def _pick(self, model: str) -> torch.nn.Module:
        if model == "actor":
            return self.model
        if model == "ref":
            if self.ref_model is None:
                raise ValueError("model='ref' needs FSDPConfig(reference=True)")
            return self.ref_model
        raise ValueError(f"model={model!r}; choose 'actor' or 'ref'")

    @contextmanager
    def _swapped_in(self, net: torch.nn.Module):
        """Bring an offloaded reference model onto the device for the duration."""
        swap = net is self.ref_model and self.config.ref_offload and self.device.type != "cpu"
        if swap:
            net.to(self.device)
        try:
            yield
        finally:
            if swap:
                net.to("cpu")
                torch.cuda.empty_cache()

    def _log_probs(self, net, mb: TrainBatch, *, with_entropy: bool, budget: int):
        return packed_log_probs(
            net,
            mb,
            impl=self.attention,
            temperature=self.config.temperature,
            chunk_size=self.config.logits_chunk_size,
            with_entropy=with_entropy,
            pad_to=budget,
        )

    # --- the loss of one micro-batch ---------------------------------------------------
    def micro_batch_loss(self, mb: TrainBatch) -> tuple[torch.Tensor, dict]:
        rl = self.config.mode == "rl"
        budget = self.config.max_tokens_per_micro_batch
        log_probs, entropy = self._log_probs(self.model, mb, with_entropy=rl, budget=budget)
        if not rl:
            return sft_objective(
                log_probs=log_probs,
                mask=mb.loss_mask,
                tensor_metrics=True,
                **self._denominators(mb),
            )
        return self._policy_loss(mb, log_probs, entropy)

    def _denominators(self, mb: TrainBatch) -> dict:
        return {
            "num_tokens": mb.global_num_tokens,
            "num_seqs": mb.global_num_seqs,
            "cu_seqlens": mb.cu_seqlens,
            "agg_mode": self.config.agg_mode,
        }

    def _policy_loss(self, mb: TrainBatch, log_probs: torch.Tensor, entropy: torch.Tensor):
        """rl_core.objective.policy_objective with this config; on-policy when the batch
        has no old log-probs (ratio 1)."""
        cfg = self.config
        if mb.advantages is None:
            raise ValueError("mode='rl' needs batch.advantages (or use mode='sft')")
        old = mb.old_log_probs if mb.old_log_probs is not None else log_probs.detach()
        weights, metrics = self._rollout_weights(mb, old)
        if mb.old_log_probs is None and mb.rollout_log_probs is not None:
            metrics["mismatch/logprob_abs_diff_mean"] = logprob_gap_share(
                old, mb.rollout_log_probs, mb.loss_mask, num_tokens=mb.global_num_tokens
            )
        loss, objective_metrics = policy_objective(
            log_probs=log_probs,
            old_log_probs=old,
            advantages=mb.advantages,
            mask=mb.loss_mask,
            loss_name=cfg.loss_name,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            dual_clip=cfg.dual_clip,
            entropy=entropy,
            entropy_coef=cfg.entropy_coef,
            ref_log_probs=mb.ref_log_probs,
            kl_coef=cfg.kl_coef,
            kl_kind=cfg.kl_kind,
            importance_weights=weights,
            norm_length=cfg.norm_length,
            tensor_metrics=True,  # summed on the device, read back once per step
            **self._denominators(mb),
        )
        metrics.update(objective_metrics)
        if mb.ref_log_probs is not None and cfg.kl_coef == 0.0:  # report KL even if unused
            kl = approx_kl(log_probs.detach(), mb.ref_log_probs, kind=cfg.kl_kind)
            metrics["actor/kl"] = self._aggregate(kl, mb)  # read back once per step
        return loss, metrics

    def _aggregate(self, per_token: torch.Tensor, mb: TrainBatch) -> torch.Tensor:
        return aggregate(
            per_token,
            mb.loss_mask,
            mode=self.config.agg_mode,
            cu_seqlens=mb.cu_seqlens,
            num_tokens=mb.global_num_tokens,
            num_seqs=mb.global_num_seqs,
            norm_length=self.config.norm_length,
        )

    def _rollout_weights(self, mb: TrainBatch, old: torch.Tensor):
        """Rollout importance weights (or None) and their metrics as shares of the step."""
        if self.config.rollout_is is None or mb.rollout_log_probs is None:
            return None, {}
        weights, metrics = rollout_importance_weights(
            old,
            mb.rollout_log_probs,
            mb.loss_mask,
            level=self.config.rollout_is_level,
            mode=self.config.rollout_is,
            cap=self.config.rollout_is_cap,
            cu_seqlens=mb.cu_seqlens,
            tensor_metrics=True,
        )
        share = mb.loss_mask.sum().to(torch.float64) / max(mb.global_num_tokens, 1.0)
        return weights, {key: value * share for key, value in metrics.items()}

    # --- weights out -------------------------------------------------------------------
    def export_weights(self, *, bucket_bytes: int):
        """Buckets of ``(hf_name, full tensor)``, at most ``bucket_bytes`` each (collective)."""
        self.onload()
        dtype = DTYPES[self.config.export_dtype] if self.config.export_dtype else None
        yield from iter_weight_buckets(self.model, bucket_bytes=bucket_bytes, dtype=dtype)

    def export_hf(self, path: Path, *, bucket_bytes: int = 1 << 30) -> None:
        """A plain HF directory (safetensors shards + config + tokenizer files) at ``path``."""
        hf_config = copy.deepcopy(self.model_config)
        if self.config.export_dtype:
            hf_config.dtype = DTYPES[self.config.export_dtype]
        buckets = self.export_weights(bucket_bytes=bucket_bytes)
        write_hf_dir(Path(path), buckets, hf_config, source_dir=self.config.model_path)
