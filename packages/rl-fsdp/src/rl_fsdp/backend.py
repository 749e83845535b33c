"""The FSDP2 actor: rl_core.protocols.TrainingBackend on a Hugging Face causal LM.

    objective = Objective(policy_loss="ppo", kl_coef=0.001)  # needs the reference model
    backend = FSDPBackend(FSDPConfig(model_path="/models/qwen", lr=1e-6, objective=objective))
    batch = shard_for_rank(global_batch, backend.dist.rank, backend.dist.world_size)
    batch.old_log_probs = backend.compute_log_probs(batch)
    batch.ref_log_probs = backend.compute_log_probs(batch, model="ref")
    metrics = backend.train_step(batch)
    for bucket in backend.export_weights(bucket_bytes=512 << 20): ...

All ranks call every method together with their own part of the batch.
"""

import copy
import dataclasses
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from rl_core.batch import TrainBatch
from rl_core.distributed import DistInfo
from rl_core.kl import approx_kl
from rl_core.objective import aggregate_batch, batch_objective_loss
from rl_core.packing import first_fit_pack
from rl_fsdp import checkpoint
from rl_fsdp.config import FSDPConfig
from rl_fsdp.distributed import all_reduce_max_int
from rl_fsdp.engine import ShardedTrainer
from rl_fsdp.forward import packed_log_probs
from rl_fsdp.lora import lora_disabled
from rl_fsdp.modeling import (
    DTYPES,
    build_model,
    compute_params_only,
    freeze,
    is_fsdp,
    reshard_all,
    shard_model,
)
from rl_fsdp.routing_replay import RouteReplay
from rl_fsdp.weights import iter_weight_buckets, write_hf_dir

__all__ = ["FSDPBackend", "FSDPConfig"]


class FSDPBackend(ShardedTrainer):
    head = "causal_lm"

    def __init__(self, config: FSDPConfig, *, dist_info: DistInfo | None = None):
        super().__init__(config, dist_info=dist_info)
        # with LoRA the reference is the actor with its adapters off (see _pick)
        separate_ref = config.loads_reference and config.lora is None
        self.ref_model = self._build_reference() if separate_ref else None
        self.reference_refreshed = False  # by update_reference: checkpoints then keep it
        self.route_replay = RouteReplay(self.model)  # MoE: the batch's routed_experts

    def _build_reference(self) -> torch.nn.Module:
        """A frozen, sharded copy of the initial weights (same source and seed), or of
        ``config.ref_path``'s."""
        source = self.config
        if source.ref_path is not None:
            source = dataclasses.replace(source, model_path=source.ref_path, model_config=None)
        ref = freeze(shard_model(build_model(source), self.config, self.device))
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
            replay = model == "actor"  # the reference routes on its own (routing_replay.py)
            return self._log_probs(net, mb, with_entropy=False, budget=budget, replay=replay)[0]

        compute = self.computing() if net is self.model else nullcontext()
        base = lora_disabled(net) if model == "ref" and self.lora else nullcontext()
        with torch.no_grad(), self._swapped_in(net), compute, base:
            out = self.per_token(batch, budget, log_probs)
            reshard_all(net)  # the root (and layers on one rank) stay gathered after forward
        out.index_fill_(0, batch.cu_seqlens[1:].long() - 1, 0.0)  # sequence ends
        return out

    @torch.no_grad()
    def update_reference(self) -> None:
        """Copy the policy's current weights into the reference model (each rank its own
        shards: both are built and sharded alike), cast to the reference's dtype."""
        if self.ref_model is None:
            raise ValueError(
                "update_reference needs a separate reference model: an objective with "
                "kl_coef or reward_kl_coef > 0, and no LoRA (whose reference is the base)"
            )
        self.onload_all()
        ref_params = dict(self.ref_model.named_parameters())
        for name, param in self.model.named_parameters():
            ref_params[name].copy_(param.detach())
        self.reference_refreshed = True

    def refreshed_reference(self) -> torch.nn.Module | None:
        """The reference model once :meth:`update_reference` changed it: a checkpoint saves
        it then (before, it is rebuilt from the starting weights or ``ref_path``)."""
        return self.ref_model if self.reference_refreshed else None

    def restore_reference(self, path: Path) -> None:
        """The reference a checkpoint saved (a refreshed one), else the one built here."""
        if self.ref_model is not None:
            self.reference_refreshed = checkpoint.load_reference(path, self.ref_model)

    def _pick(self, model: str) -> torch.nn.Module:
        if model == "actor":
            return self.model
        if model == "ref":
            if self.lora is not None:
                return self.model  # the base: compute_log_probs turns the adapters off
            if self.ref_model is None:
                raise ValueError(
                    "model='ref' needs a reference: FSDPConfig(reference=True) or an "
                    "objective with kl_coef or reward_kl_coef > 0"
                )
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

    def _log_probs(self, net, mb: TrainBatch, *, with_entropy: bool, budget: int, replay=True):
        if net is self.model:  # the routes stay set for a checkpointed layer's recompute
            self.route_replay.use(mb.routed_experts if replay else None)
        return packed_log_probs(
            net,
            mb,
            impl=self.attention,
            temperature=self.config.objective.temperature,
            chunk_size=self.config.logits_chunk_size,
            with_entropy=with_entropy,
            pad_to=budget,
        )

    # --- the loss of one micro-batch ---------------------------------------------------
    def plan(self, batch: TrainBatch, max_tokens: int) -> list[list[int]]:
        """The trainer's micro-batches, except that with the "dpo" objective each pair
        (sequences 2p, 2p + 1: chosen, rejected) stays whole in one micro-batch, as its
        loss needs both sequences' log-probs."""
        if self.config.objective.mode != "dpo":
            return super().plan(batch, max_tokens)
        lengths = batch.seq_lengths()
        assert len(lengths) % 2 == 0, "a dpo batch holds pairs: an even number of sequences"
        pair_lengths = [lengths[i] + lengths[i + 1] for i in range(0, len(lengths), 2)]
        parts = first_fit_pack(pair_lengths, max_tokens=max_tokens)
        parts += [[] for _ in range(all_reduce_max_int(len(parts), self.device) - len(parts))]
        return [[seq for pair in part for seq in (2 * pair, 2 * pair + 1)] for part in parts]

    def micro_batch_loss(self, mb: TrainBatch) -> tuple[torch.Tensor, dict]:
        """rl_core.objective.batch_objective_loss of the config's objective, metrics as 0-d
        device tensors (summed on the device, read back once per step)."""
        objective = self.config.objective
        policy = objective.mode == "policy"
        budget = self.config.max_tokens_per_micro_batch
        log_probs, entropy = self._log_probs(self.model, mb, with_entropy=policy, budget=budget)
        loss, metrics = batch_objective_loss(objective, mb, log_probs, entropy, tensor_metrics=True)
        if policy and mb.ref_log_probs is not None and objective.kl_coef == 0.0:
            kl = approx_kl(log_probs.detach(), mb.ref_log_probs, kind=objective.kl_kind)
            metrics["actor/kl"] = aggregate_batch(objective, kl, mb)  # reported even if unused
        return loss, metrics

    # --- weights out -------------------------------------------------------------------
    def export_weights(self, *, bucket_bytes: int):
        """Buckets of ``(hf_name, full tensor)``, at most ``bucket_bytes`` each (collective);
        with LoRA the base's names with the adapters merged in (what any engine loads)."""
        self.onload_all()
        dtype = DTYPES[self.config.export_dtype] if self.config.export_dtype else None
        scaling = self.lora.scaling if self.lora is not None else None
        yield from iter_weight_buckets(
            self.model,
            bucket_bytes=bucket_bytes,
            dtype=dtype,
            lora_scaling=scaling,
            copies=self._export_copies(dtype, scaling),
        )

    def _export_copies(self, dtype, lora_scaling) -> dict | None:
        """A single rank's compute copy where it holds what an export in ``dtype`` sends
        (no LoRA merge): one cast per step instead of one per parameter and sync."""
        if self.master is None or lora_scaling is not None or dtype != self.master.compute.dtype:
            return None
        return self.master.compute_copies()

    def export_lora_adapter(self, path: Path) -> int:
        """The LoRA adapters alone as a PEFT directory at ``path`` (collective; rank 0
        writes it atomically), what an engine serving the base loads per version. Returns
        the adapter tensors' bytes."""
        from rl_fsdp.lora_export import write_peft_adapter

        if self.lora is None:
            raise ValueError("export_lora_adapter needs a model with LoRA (FSDPConfig.lora)")
        self.onload_all()
        dtype = DTYPES[self.config.export_dtype] if self.config.export_dtype else None
        return write_peft_adapter(
            self.model, self.lora, Path(path), base_model=self.config.model_path, dtype=dtype
        )

    def export_hf(self, path: Path, *, bucket_bytes: int = 1 << 30) -> None:
        """A plain HF directory (safetensors shards + config + tokenizer files) at ``path``."""
        hf_config = copy.deepcopy(self.model_config)
        if self.config.export_dtype:
            hf_config.dtype = DTYPES[self.config.export_dtype]
        buckets = self.export_weights(bucket_bytes=bucket_bytes)
        write_hf_dir(Path(path), buckets, hf_config, source_dir=self.config.model_path)
