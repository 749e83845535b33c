"""``MegatronBackend``: rl_core's TrainingBackend on a megatron-core GPTModel.

One instance per rank; all ranks call each method together with their data-parallel share
of the batch (TP ranks of one DP rank get the same batch). Maths comes from rl_core:
per-token losses aggregated with the step's global denominators, so micro-batching and the
TP/DP/EP layout leave the loss and gradients unchanged.
"""

import contextlib
import math
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from rl_core.batch import TrainBatch
from rl_core.distributed import init_distributed
from rl_megatron import checkpoint, faults, optim, pipeline
from rl_megatron.compiled_layers import compile_layers
from rl_megatron.config import MegatronConfig
from rl_megatron.cp import restrict_batch
from rl_megatron.forward import (
    forward_logits,
    held_targets,
    log_probs_and_entropy,
    model_inputs,
    padded_micro_batches,
    padded_shape,
)
from rl_megatron.fusions import fused_swiglu_works
from rl_megatron.models import build_critic_model, build_gpt_model
from rl_megatron.moe import ep_common_shape, ep_synced_groups
from rl_megatron.objective import actor_loss, critic_loss
from rl_megatron.parallel import current_layout, initialize_parallel
from rl_megatron.precision import DTYPES, finish_accumulation
from rl_megatron.routing_replay import RouteReplay
from rl_megatron.shape import model_shape
from rl_megatron.state import WeightsAndStateMixin
from rl_megatron.weights import (
    SafetensorsReader,
    freeze_by_hf_name,
    hf_config_of,
    load_hf_weights,
    read_shards,
)

REFERENCE_DIR = "reference"  # a checkpoint's refreshed KL reference, as HF safetensors


class MegatronBackend(WeightsAndStateMixin):
    """Actor, reference and SFT model (the objective's ``mode`` "policy"/"sft") or a critic
    (``MegatronConfig(critic=True)``).

    Forward passes and training live here; weight export, checkpoints and offload in
    :class:`rl_megatron.state.WeightsAndStateMixin`."""

    step: int  # optimizer steps taken

    @classmethod
    def start(
        cls,
        config: MegatronConfig,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
    ) -> "MegatronBackend":
        """Join the ranks' process group (rl_core.distributed.init_distributed: gloo on
        CPU, nccl on GPU), install the CPU shim on CPU, then build megatron's groups and
        the model (rl_core.protocols.TrainingBackend.start)."""
        init_distributed(
            device=config.device,
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
        )
        if config.device == "cpu":  # megatron-core allocates on "cuda" unless shimmed
            from rl_megatron.testing import cpu_shim

            cpu_shim.install(config.seed)
        return cls(config)

    def __init__(self, config: MegatronConfig):
        from megatron.core import parallel_state as ps

        self.config = config
        self.layout = _parallel_layout(config)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()  # ranks with different data
        self.dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)  # grads
        self.cp_group = ps.get_context_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.ep_group = ps.get_expert_model_parallel_group()
        self.expert_groups = (ps.get_expert_tensor_parallel_group(), self.ep_group)
        self.expert_dp_group = ps.get_expert_data_parallel_group()
        self.device = torch.device("cpu" if config.device == "cpu" else torch.cuda.current_device())
        self.hf_config = hf_config_of(config.hf_path)
        self.shape = model_shape(self.hf_config, tp_size=config.tp)
        if config.critic:  # its value head replaces the LM head: nothing is tied
            self.shape = replace(self.shape, tie_embeddings=False)
        if self.shape.num_experts and config.tp > 1 and not config.sequence_parallel:
            raise ValueError("megatron needs sequence_parallel=True for MoE models with tp > 1")
        self.chunks = self._build_chunks()  # this stage's model chunks (vpp of them)
        self.compiled_layers = {}  # compile_layers: {"whole_layers": n, "norms_only_layers": m}
        if config.compile_layers:
            self.compiled_layers = compile_layers(self.chunks)
        self.model = self.chunks[0]  # the model (with vpp > 1: its first chunk)
        for chunk in self.chunks:
            freeze_by_hf_name(chunk, self.shape, self.layout, config.train_only, config.freeze)
        named = [(n, p) for n, p in self._named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.expert_params = [p for n, p in named if ".mlp.experts." in n]
        self.optimizer = optim.make_optimizer(self.params, config, self.layout, self.dp_cp_group)
        self.ref_shards = None
        if config.ref_path is not None:
            self.ref_shards = self._read_reference(config.ref_path)
        self.reference_refreshed = False  # by update_reference: checkpoints then keep it
        self.step = 0
        self.pipeline_stats: dict = {}  # pp > 1: the last step's schedule (peak_held)
        self.route_replay = self._route_replay()  # MoE: the batch's routed_experts (R3)

    def _build_chunks(self) -> list:
        """One model per virtual pipeline stage of this rank (one without vpp)."""
        vpp, options = self.config.vpp, self.config.megatron_options().transformer
        if vpp == 1:
            return [self._build_model(options)]
        # batch_p2p_comm off: megatron's batched exchange posts a stage's two receives from
        # one peer (pp=2) in the opposite order of that peer's sends; the unbatched one
        # keeps the two directions on two process groups
        virtual = {"virtual_pipeline_model_parallel_size": vpp, "batch_p2p_comm": False}
        return [self._build_model(options | virtual, vp_stage=c) for c in range(vpp)]

    def _named_parameters(self):
        """``(name, parameter)`` over the model chunks (:func:`pipeline.chunk_key` names)."""
        for index, chunk in enumerate(self.chunks):
            for name, param in chunk.named_parameters():
                yield pipeline.chunk_key(index, name), param

    def _build_model(self, options: dict, vp_stage: int | None = None):
        build = build_critic_model if self.config.critic else build_gpt_model
        model = build(
            self.hf_config,
            tp_size=self.config.tp,
            ep_size=self.config.ep,
            cp_size=self.config.cp,
            **({"pp_size": self.config.pp} if self.config.pp > 1 else {}),
            sequence_parallel=self.config.sequence_parallel,
            dtype=DTYPES[self.config.precision],
            swiglu_fusion=self.config.swiglu_fusion and self._swiglu_fusion_works(),
            options=options,
            vp_stage=vp_stage,
            rotary_table=self.config.rotary_table,
            fused_qkv_rotary=self.config.fused_qkv_rotary,
            attention_backends=self.config.attention_backends,
        )
        load_hf_weights(model, SafetensorsReader(self.config.hf_path), self.shape, self.layout)
        return model.to(self.device)

    def _route_replay(self) -> RouteReplay:
        """Replay of rollout routes on the policy's routers (routing_replay.py)."""
        layout = self.layout
        return RouteReplay(
            self.chunks,
            cp_size=layout.cp_size,
            cp_rank=layout.cp_rank,
            tp_size=layout.tp_size,
            tp_rank=layout.tp_rank,
            enabled=not self.config.critic,
        )

    def _swiglu_fusion_works(self) -> bool:
        width = 2 * (self.shape.moe_ffn_hidden_size or self.shape.ffn_hidden_size) // self.config.tp
        return fused_swiglu_works(self.device, DTYPES[self.config.precision], width)

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel index: its TP / PP / CP peers share its batch."""
        return self.layout.dp_rank

    # ----------------------------------------------------------------- forward passes
    def _multiple(self) -> int:
        """Row widths divide by this: tp (sequence parallel) times 2·cp (zigzag chunks),
        and by ``width_bucket`` (fewer distinct shapes)."""
        layout = self.config.tp * (2 * self.config.cp if self.config.cp > 1 else 1)
        return math.lcm(layout, self.config.width_bucket)

    def micro_batch_shapes(self, batch: TrainBatch) -> list[tuple[int, int]]:
        """Padded ``(rows, width)`` of each micro-batch of ``batch`` on this rank (before a
        CP split or EP's common shape): the shapes attention runs on."""
        groups = self._micro_batches(batch.seq_lengths())
        return [padded_shape(batch.select(group).cu_seqlens, self._multiple()) for group in groups]

    def _per_token(self, part: TrainBatch, *, with_entropy: bool):
        """``(log_probs, entropy or None, held)`` or, for a critic, ``(values, None, held)``:
        ``[N_held]`` each, for the tokens of ``part`` this CP rank holds (indices ``held``)."""
        logits, held = forward_logits(
            self.model,
            part.tokens,
            part.cu_seqlens,
            multiple=self._multiple(),
            min_shape=self._min_shape(part),
            cp_size=self.layout.cp_size,
            cp_rank=self.layout.cp_rank,
        )
        return (*self._head(part, logits, held, with_entropy=with_entropy), held)

    def _min_shape(self, part: TrainBatch) -> tuple[int, int]:
        """``[B, T]`` every EP rank pads ``part`` to (their common one; (0, 0) without EP).
        A collective over the EP group: EP peers call it for the same micro-batches."""
        if self.layout.ep_size == 1:  # an empty (padding) micro-batch: one row of padding
            return (0, 0) if part.num_seqs else (1, self._multiple())
        local = padded_shape(part.cu_seqlens, self._multiple())
        return ep_common_shape(local, self.ep_group, self.device)

    def _stage_inputs(
        self, parts: list[TrainBatch], *, same_shape: bool = False
    ) -> list[pipeline.ModelInputs]:
        """Each part's model inputs for the pipeline, computed (with the EP collectives)
        before the schedule starts: this CP rank's zigzag part of the padded rows;
        ``same_shape``: all padded to the largest rows and width (megatron's interleaved
        schedule sends one activation shape)."""
        shapes = [self._min_shape(part) for part in parts]
        if same_shape:
            sizes = shapes + [padded_shape(p.cu_seqlens, self._multiple()) for p in parts]
            shapes = [tuple(max(size[d] for size in sizes) for d in (0, 1))] * len(parts)
        return [
            model_inputs(
                part.tokens,
                part.cu_seqlens,
                multiple=self._multiple(),
                min_shape=shape,
                cp_size=self.layout.cp_size,
                cp_rank=self.layout.cp_rank,
            )
            for part, shape in zip(parts, shapes, strict=True)
        ]

    def _head(self, part: TrainBatch, logits, held, *, with_entropy: bool):
        """Logits ``[N_held, V/tp]`` -> ``(log_probs, entropy or None)``; critic: values."""
        if self.config.critic:
            return logits[:, 0].float(), None
        return log_probs_and_entropy(
            logits,
            held_targets(part.tokens, part.cu_seqlens, held),
            vocab_size=self.shape.vocab_size,
            tp_group=self.tp_group,
            temperature=self.config.objective.temperature,
            chunk_size=self.config.logprob_chunk_size,
            with_entropy=with_entropy,
        )

    def _micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """Sequence groups within the token budget (padded cost); EP ranks agree on a count."""
        groups = padded_micro_batches(lengths, self.config.max_tokens_per_micro_batch)
        if self.layout.ep_size == 1:
            return groups
        return ep_synced_groups(groups, self.ep_group, self.device)

    @torch.no_grad()
    def _forward_all(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token outputs ``[N]`` of the whole batch (every rank gets all of them)."""
        for chunk in self.chunks:
            chunk.eval()
        bounds = batch.cu_seqlens.tolist()
        groups = self._micro_batches(batch.seq_lengths())
        batch = batch.to(self.device)
        self.route_replay.feed(batch, groups)
        result = torch.zeros(batch.num_tokens, device=self.device)
        for group, output, held in self._forward_outputs(batch, groups):
            token_index = [torch.arange(bounds[i], bounds[i + 1]) for i in group]
            if token_index:
                result[torch.cat(token_index).to(self.device)[held]] = output.float()
        for size, group in ((self.layout.cp_size, self.cp_group), (self.config.pp, self.pp_group)):
            if size > 1:  # each token's output lives on exactly one CP rank / the last stage
                dist.all_reduce(result, group=group)
        return result

    def _forward_outputs(self, batch: TrainBatch, groups: list[list[int]]):
        """``(group, output [N_held], held)`` per micro-batch (pp: on the last stage only)."""
        if self.config.pp == 1:
            for group in groups:
                output, _, held = self._per_token(batch.select(group), with_entropy=False)
                yield group, output, held
            return

        def outputs(part, logits, held):
            output, _ = self._head(part, logits, held, with_entropy=False)
            return output.sum() * 0.0, {"output": output, "held": held}

        reduced = self._run_pipeline(batch, groups, outputs, forward_only=True)
        for group, item in zip(groups, reduced, strict=False):
            yield group, item["output"], item["held"]

    def compute_log_probs(self, batch: TrainBatch, *, model: str = "actor") -> torch.Tensor:
        """Log-probs ``[N]`` (prediction at position) of the actor or the reference model."""
        if self.config.critic:
            raise ValueError("a critic has no log-probs; call compute_values")
        if model == "actor":
            return self._forward_all(batch)
        if model != "ref" or self.ref_shards is None:
            raise ValueError(f"model must be 'actor' or 'ref' (ref needs ref_path), got {model!r}")
        with self._swapped_weights(self.ref_shards), self.route_replay.off():
            return self._forward_all(batch)  # the reference routes on its own

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Critic values ``[N]`` of every position."""
        if not self.config.critic:
            raise ValueError("compute_values needs MegatronConfig(critic=True)")
        return self._forward_all(batch)

    @torch.no_grad()
    def update_reference(self) -> None:
        """The reference's shards become copies of this rank's current parameters (kept
        on the host, like the ones read from ``ref_path``)."""
        if self.ref_shards is None:
            raise ValueError("update_reference needs a reference: MegatronConfig.ref_path")
        params = dict(self._named_parameters())
        self.ref_shards = {
            name: params[name].detach().to("cpu", copy=True) for name in self.ref_shards
        }
        self.reference_refreshed = True

    def _read_reference(self, hf_dir) -> dict[str, torch.Tensor]:
        """This rank's shards of the HF weights in ``hf_dir``, on the host."""
        reader = SafetensorsReader(hf_dir)
        return {
            pipeline.chunk_key(index, name): shard
            for index, chunk in enumerate(self.chunks)
            for name, shard in read_shards(chunk, reader, self.shape, self.layout).items()
        }

    def save_checkpoint(self, path: Path) -> None:
        """The distributed checkpoint, and a reference :meth:`update_reference` refreshed
        as an HF directory ``reference/`` in it (any layout reads it back, as ``ref_path``);
        the starting reference is read from ``ref_path`` again instead."""
        super().save_checkpoint(path)
        if self.reference_refreshed:
            with torch.no_grad(), self._swapped_weights(self.ref_shards):
                self.export_hf(Path(path) / REFERENCE_DIR)

    def load_checkpoint(self, path: Path) -> None:
        super().load_checkpoint(path)
        reference = checkpoint.complete_path(Path(path)) / REFERENCE_DIR
        if self.ref_shards is not None and reference.is_dir():
            self.ref_shards = self._read_reference(reference)
            self.reference_refreshed = True

    @contextlib.contextmanager
    def _swapped_weights(self, shards: dict[str, torch.Tensor]):
        params = dict(self._named_parameters())
        saved = {name: params[name].data for name in shards}
        try:
            for name, shard in shards.items():  # kept in the file's dtype, cast here
                params[name].data = shard.to(self.device, dtype=saved[name].dtype)
            yield
        finally:
            for name, data in saved.items():
                params[name].data = data

    # ----------------------------------------------------------------- training
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Micro-batched forward/backward with rl_core losses, DP gradient sum, clip, AdamW
        at the schedule's lr for this step (``train/lr``, as rl-fsdp reports it).

        NaN or inf in the loss or gradient norm on any rank skips the update on every rank
        (:mod:`rl_megatron.faults`): weights, optimizer state and ``step`` stay unchanged
        and ``train/nonfinite_skipped`` is 1."""
        lr = optim.set_lr(self.optimizer, self.config, self.step)
        metrics = self.forward_backward(batch)
        grad_norm = self.grad_norm()
        skipped = faults.any_rank_nonfinite(metrics, grad_norm, self.device)
        if not skipped:
            with optim.clipped(
                self.optimizer, self.params, max_norm=self.config.clip_grad, norm=grad_norm
            ):
                self.optimizer.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {
            **metrics,
            "train/grad_norm": grad_norm,
            "train/lr": lr,
            "train/nonfinite_skipped": float(skipped),
        }

    def forward_backward(self, batch: TrainBatch) -> dict[str, float]:
        """Accumulate this step's full gradient (summed over DP ranks) without stepping;
        returns the loss metrics summed over micro-batches and DP ranks."""
        batch = self._with_denominators(batch)
        groups = self._micro_batches(batch.seq_lengths())  # before the copy: no device sync
        batch = batch.to(self.device)
        self.route_replay.feed(batch, groups)
        for chunk in self.chunks:
            chunk.train()
        if self.config.pp > 1:
            metrics = self._pipeline_forward_backward(batch, groups)
        else:
            metrics = self._local_forward_backward(batch, groups)
        finish_accumulation(self.params)  # bf16: zero main grads no backward wrote
        self._reduce_grads()
        return self._sum_over(dict(metrics), self.dp_cp_group)

    def _local_forward_backward(self, batch: TrainBatch, groups) -> dict[str, float]:
        """Metrics summed on the device and read back once: no host sync between a
        micro-batch's forward and its backward (the GPU would idle while the host reads)."""
        metrics: dict = defaultdict(float)
        for group in groups:
            part = batch.select(group)
            first, entropy, held = self._per_token(part, with_entropy=self.config.role == "policy")
            loss, part_metrics = self._loss(part, first, entropy, held, tensor_metrics=True)
            loss.backward()
            for key, value in part_metrics.items():
                is_tensor = isinstance(value, torch.Tensor)
                metrics[key] += value.detach().double() if is_tensor else value
        return _read_back(metrics)

    def _loss(self, part: TrainBatch, first, entropy, held, *, tensor_metrics: bool = False):
        part = restrict_batch(part, held)
        if self.config.critic:
            return critic_loss(self.config, part, first)
        return actor_loss(self.config, part, first, entropy, tensor_metrics=tensor_metrics)

    def _pipeline_forward_backward(self, batch: TrainBatch, groups) -> dict[str, float]:
        def stage_loss(part, logits, held):
            first, entropy = self._head(
                part, logits, held, with_entropy=self.config.role == "policy"
            )
            return self._loss(part, first, entropy, held)

        reduced = self._run_pipeline(batch, groups, stage_loss, forward_only=False)
        metrics: dict[str, float] = defaultdict(float)
        for part_metrics in reduced:
            for key, value in part_metrics.items():
                metrics[key] += value
        return pipeline.broadcast_from_last_stage(dict(metrics))

    def _run_pipeline(self, batch: TrainBatch, groups, loss_fn, *, forward_only: bool):
        """The last stage's per-micro-batch metrics of the pipeline schedule: the backend's
        own 1F1B / GPipe, or with vpp > 1 megatron's interleaved one over the model chunks
        (micro-batches of one padded shape, their count made a multiple of pp with empty
        ones)."""
        parts = [batch.select(group) for group in groups]
        if self.config.vpp == 1:
            return pipeline.run_schedule(
                self.model,
                parts,
                inputs=self._stage_inputs(parts),
                loss_fn=loss_fn,
                forward_only=forward_only,
                schedule=self.config.pp_schedule,
                stats=self.pipeline_stats,
            )
        stages = self.config.pp
        parts += [batch.select([])] * (max(1, -(-len(parts) // stages)) * stages - len(parts))
        return pipeline.run_interleaved(
            self.chunks,
            parts,
            inputs=self._stage_inputs(parts, same_shape=True),
            loss_fn=loss_fn,
            forward_only=forward_only,
        )

    def _reduce_grads(self) -> None:
        """Dense grads summed over DP×CP, expert grads over expert-DP, partial replicas over TP."""
        expert_ids = {id(p) for p in self.expert_params}
        dense = [p for p in self.params if id(p) not in expert_ids]
        optim.all_reduce_grads(dense, self.dp_cp_group)
        optim.all_reduce_grads(self.expert_params, self.expert_dp_group)
        for chunk in self.chunks:
            optim.all_reduce_grads(optim.tp_partial_params(chunk), self.tp_group)
        if self.config.pp > 1 and self.shape.tie_embeddings:  # first-stage and last-stage copies
            from megatron.core import parallel_state as ps

            if ps.is_rank_in_embedding_group():
                holder = self.chunks[0] if self.chunks[0].pre_process else self.chunks[-1]
                weight = holder.shared_embedding_or_output_weight()
                optim.all_reduce_grads([weight], ps.get_embedding_group())

    def grad_norm(self) -> float:
        """Global L2 norm of the accumulated gradient (every shard and expert counted once)."""
        return optim.global_grad_norm(
            self._norm_params(),
            self.tp_group,
            expert_params=self.expert_params,
            expert_groups=self.expert_groups,
            stage_group=self.pp_group,
        )

    def _norm_params(self) -> list[torch.nn.Parameter]:
        """Every parameter once: the last stage's copy of tied embeddings is left out."""
        if self.config.pp > 1 and self.shape.tie_embeddings and self.chunks[-1].post_process:
            replica = self.chunks[-1].output_layer.weight
            return [p for p in self.params if p is not replica]
        return self.params

    def _with_denominators(self, batch: TrainBatch) -> TrainBatch:
        if batch.global_num_tokens is not None and batch.global_num_seqs is not None:
            return batch
        local = batch.with_global_denominators()
        counts = self._sum_over(
            {"t": local.global_num_tokens, "s": local.global_num_seqs}, self.dp_group
        )
        return replace(batch, global_num_tokens=counts["t"], global_num_seqs=counts["s"])

    def _sum_over(self, metrics: dict[str, float], group) -> dict[str, float]:
        if dist.get_world_size(group) == 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(values, group=group)
        return dict(zip(keys, values.tolist(), strict=True))


def _read_back(metrics: dict) -> dict[str, float]:
    """``metrics`` with its device tensors read back to floats in one copy."""
    keys = [key for key, value in metrics.items() if isinstance(value, torch.Tensor)]
    values = torch.stack([metrics[key] for key in keys]).tolist() if keys else []
    return {**metrics, **dict(zip(keys, values, strict=True))}


def _parallel_layout(config: MegatronConfig):
    """Reuse megatron's groups when they already have this TP/EP layout, else create them."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        layout = current_layout()
        sizes = (layout.tp_size, layout.pp_size, layout.cp_size, layout.ep_size, layout.vpp_size)
        if sizes == (config.tp, config.pp, config.cp, config.ep, config.vpp):
            return layout
    return initialize_parallel(
        tp=config.tp,
        pp=config.pp,
        cp=config.cp,
        vpp=config.vpp,
        ep=config.ep,
        seed=config.seed,
        device=config.device,
    )
