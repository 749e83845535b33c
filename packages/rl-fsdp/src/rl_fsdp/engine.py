"""What the actor and the critic share: a sharded model, its optimizer, the micro-batched
optimizer step, checkpoints and offloading. Subclasses supply the per-micro-batch loss.

Loss scaling: every micro-batch loss is its share of the whole step's loss (global
denominators from rl_core), so the step's gradient is the *sum* over micro-batches and
ranks. FSDP averages gradients over ranks, hence the backward of ``loss · world_size``.
"""

import math
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from rl_core.batch import TrainBatch, to_device
from rl_core.distributed import DistInfo, init_distributed
from rl_fsdp import checkpoint, faults
from rl_fsdp.attention import all_equal_lengths, equal_lengths_batched, resolve_attention
from rl_fsdp.config import FSDPConfig
from rl_fsdp.distributed import (
    add_metrics,
    all_reduce_max_int,
    all_reduce_metrics,
    global_denominators,
)
from rl_fsdp.forward import micro_batch, plan_micro_batches, token_indices
from rl_fsdp.lora import add_lora
from rl_fsdp.master import MasterWeights
from rl_fsdp.metrics import train_flops
from rl_fsdp.modeling import (
    DTYPES,
    build_model,
    freeze_by_name,
    gathered_through,
    is_fsdp,
    place_adapted,
    reshard_after_backward,
    shard_model,
)
from rl_fsdp.offload import HostStash, optimizer_state_tensors
from rl_fsdp.optim import build_optimizer


class ShardedTrainer:
    head = "causal_lm"
    takes_lora = True  # config.lora adapts this model (the critic's value head must train)
    step: int  # optimizer steps taken

    @classmethod
    def start(
        cls, config: FSDPConfig, *, rank: int, world_size: int, master_addr: str, master_port: int
    ):
        """Join the ranks' process group (rl_core.distributed.init_distributed: gloo on
        CPU, nccl on GPU) and build the model (rl_core.protocols.TrainingBackend.start)."""
        dist_info = init_distributed(
            device=config.device,
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
        )
        return cls(config, dist_info=dist_info)

    def __init__(self, config: FSDPConfig, *, dist_info: DistInfo | None = None):
        self.config = config
        self.dist = dist_info or init_distributed(device=config.device)
        self.device = self.dist.device
        self.attention = resolve_attention(config.attention, self.device, config.precision)
        model = build_model(config, head=self.head)
        self.model_config = model.config
        freeze_by_name(model, config.train_only, config.freeze)  # before sharding and optimizer
        self.lora = config.lora if self.takes_lora else None
        if self.lora is not None:
            add_lora(model, self.lora)  # before sharding: FSDP2 shards adapters with their layer
        self.model = shard_model(model, config, self.device)
        # Without FSDP (one GPU by default): float32 masters and a bf16 compute copy.
        self.master = None
        if not is_fsdp(self.model) and self.lora is not None:
            place_adapted(self.model, self.device, DTYPES[config.precision])
        elif not is_fsdp(self.model):
            self.master = MasterWeights(self.model, DTYPES[config.precision], self.device)
        self.optimizer, self.scheduler = build_optimizer(self.model, config)
        self.step = 0
        self.offloaded = False
        # pinned host copies while offloaded (colocated turns): what forward passes read,
        # and what only the update reads, which comes back on a side stream (onload)
        self._forward_stash, self._update_stash = HostStash(), HostStash()
        self._onload_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def data_rank(self) -> int:
        """Every rank trains on its own batch (FSDP shards parameters, not batches)."""
        return self.dist.rank

    # --- to be provided by subclasses --------------------------------------------------
    def micro_batch_loss(self, mb: TrainBatch) -> tuple[torch.Tensor, dict]:
        """Loss of one micro-batch (its share of the step's loss) and its metric shares
        (floats, or 0-d device tensors to be read back once per step)."""
        raise NotImplementedError

    # --- the step ----------------------------------------------------------------------
    def plan(self, batch: TrainBatch, max_tokens: int) -> list[list[int]]:
        """Micro-batches of this rank, padded to the largest count over ranks."""
        plan = plan_micro_batches(batch, max_tokens)
        return plan_micro_batches(batch, max_tokens, all_reduce_max_int(len(plan), self.device))

    def per_token(self, batch: TrainBatch, budget: int, forward) -> torch.Tensor:
        """``[N]`` float32 on the device: ``forward(micro_batch)`` (``[n]`` per micro-batch
        of ``budget`` tokens) placed at its tokens' positions in ``batch`` (on the device).
        The caller sets the grad mode and reshards afterwards."""
        out = torch.zeros(batch.num_tokens, dtype=torch.float32, device=self.device)
        plan = self.plan(batch, budget)
        with equal_lengths_batched(all_equal_lengths(batch.seq_lengths(), plan)):
            for seqs in plan:
                values = forward(micro_batch(batch, seqs))
                if seqs:  # an empty plan entry is a dummy pass that keeps ranks in step
                    out[to_device(token_indices(batch, seqs), self.device)] = values
        return out

    def forward_backward(self, batch: TrainBatch) -> dict[str, float]:
        """Accumulate this step's gradients over micro-batches; metrics summed over ranks."""
        return all_reduce_metrics(self._accumulate(batch), self.device)

    def _accumulate(self, batch: TrainBatch) -> dict[str, float | torch.Tensor]:
        """Backward of every micro-batch; metric shares summed on this rank, tensor-valued
        ones kept on the device (read back once per step)."""
        # denominators on the host, then one asynchronous copy: nothing here waits for the
        # device, so the host queues the next micro-batch while the last one still runs
        batch = global_denominators(batch, self.device).to(self.device)
        sums: dict[str, float | torch.Tensor] = {}
        keep = not reshard_after_backward(self.config, self.dist.world_size)
        plan = self.plan(batch, self.config.max_tokens_per_micro_batch)
        equal = equal_lengths_batched(all_equal_lengths(batch.seq_lengths(), plan))
        with self.computing(), gathered_through(self.model, keep), equal:
            for seq_indices in plan:
                loss, metrics = self.micro_batch_loss(micro_batch(batch, seq_indices))
                (loss * self.dist.world_size).backward()
                if self.master is not None:
                    self.master.accumulate()
                add_metrics(sums, metrics)
        sums["perf/num_tokens"] = float(batch.num_tokens)
        sums["perf/attn_tokens_sq"] = float(sum(n * n for n in batch.seq_lengths()))
        return sums

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """zero_grad, micro-batched forward/backward, clip, AdamW step, schedule step.

        Nothing is read back from the device until the optimizer step is queued; then the
        step's metrics, the gradient norm and the skip decision come back in one read.
        A non-finite loss or gradient norm on any rank skips the update on every rank
        (:mod:`rl_fsdp.faults`): parameters, optimizer state, schedule and ``step`` stay
        unchanged and ``train/nonfinite_skipped`` is 1."""
        self.onload()
        start = time.perf_counter()
        self.zero_grad()
        sums = self._accumulate(batch)
        grad_norm = self.clip_gradients()
        flag = faults.nonfinite_flag(sums, grad_norm, self.device)
        self._update_stash.ready()  # the master weights and moments the onload sent last
        faults.guarded_step(self.optimizer, flag)
        if self.master is not None:
            self.master.refresh()  # unchanged values when the step was skipped
        late = {"train/grad_norm": grad_norm, "train/nonfinite_skipped": flag}
        metrics = all_reduce_metrics(sums, self.device, unreduced=late)
        skipped = bool(metrics.pop("train/nonfinite_skipped"))
        grad_norm = metrics.pop("train/grad_norm")
        metrics.update(faults.step_metrics(skipped=skipped, grad_norm=grad_norm))
        metrics["train/lr"] = self.scheduler.get_last_lr()[0]
        if skipped:
            self.zero_grad()  # drop the poisoned gradients
        else:
            self.scheduler.step()
            self.step += 1
        metrics["train/step"] = float(self.step)
        metrics.update(self._throughput(metrics, time.perf_counter() - start))
        return metrics

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not None:
            self.master.zero_grads()

    def computing(self):
        """Context of forward and backward passes: without FSDP, the parameters are their
        bf16 compute copy within (:meth:`rl_fsdp.master.MasterWeights.computing`)."""
        return self.master.computing() if self.master is not None else nullcontext()

    def clip_gradients(self) -> torch.Tensor:
        """Global gradient norm (all shards) before clipping, a 0-d tensor left on the
        device (no read-back); clips to max_grad_norm."""
        max_norm = self.config.max_grad_norm or math.inf
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm

    def _throughput(self, metrics: dict[str, float], seconds: float) -> dict[str, float]:
        tokens = metrics.pop("perf/num_tokens")
        attn_sq = metrics.pop("perf/attn_tokens_sq")
        out = {"perf/tokens_per_s": tokens / seconds, "perf/step_s": seconds}
        if self.config.peak_tflops:
            flops = train_flops(self.model_config, num_tokens=tokens, attn_tokens_sq=attn_sq)
            peak = self.config.peak_tflops * 1e12 * self.dist.world_size
            out["perf/mfu"] = flops / seconds / peak
        return out

    # --- checkpoints and memory --------------------------------------------------------
    def save_checkpoint(self, path: Path) -> None:
        """Model, optimizer and schedule; with LoRA only the adapters and their optimizer
        state, plus ``adapter.json`` (base model and spec) to rebuild the model from."""
        self.onload_all()
        checkpoint.save(
            Path(path),
            self.model,
            self.optimizer,
            self.scheduler,
            self.step,
            adapter=self.adapter_info(),
            reference=self.refreshed_reference(),
        )

    def load_checkpoint(self, path: Path) -> None:
        self.onload_all()
        self.step = checkpoint.load(
            Path(path), self.model, self.optimizer, self.scheduler, adapter=self.adapter_info()
        )
        if self.master is not None:
            self.master.refresh()
        self.restore_reference(Path(path))

    def refreshed_reference(self) -> torch.nn.Module | None:
        """A reference model a checkpoint must keep (one no longer rebuilt from where it
        came from); None here: a trainer without a reference."""
        return None

    def restore_reference(self, path: Path) -> None:
        """Load the reference :meth:`refreshed_reference` saved into ``path``, if any."""

    def adapter_info(self) -> dict | None:
        """What an adapter-only checkpoint needs besides the adapters: the base model (its
        path, or its config fields with the seed of its random init) and the LoRA spec."""
        if self.lora is None:
            return None
        base = {"model_path": self.config.model_path, "model_config": self.config.model_config}
        return {"base": {**base, "seed": self.config.seed}, "lora": self.lora.to_dict()}

    def offload(self) -> None:
        """Training state to pinned host memory, freeing its device memory
        (:mod:`rl_fsdp.offload`; a no-op on a CPU run). The finished step's gradients are
        dropped (the next step starts from zero)."""
        if self.device.type != "cpu" and not self.offloaded:
            # not self.zero_grad(): the master's gradient buffers are freed below, not zeroed
            self.optimizer.zero_grad(set_to_none=True)
            forward, update = self._stashed()
            self._forward_stash.release(t for t in forward if t.device.type == "cuda")
            self._update_stash.release(t for t in update if t.device.type == "cuda")
            if self.master is not None:
                self.master.free_gradients()  # zero-filled again on onload
            torch.cuda.empty_cache()
        self.offloaded = True

    def _stashed(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What an offload keeps: what forward passes read (the compute copy, or the
        parameters) and what only the optimizer step reads (master weights, moments)."""
        state = list(optimizer_state_tensors(self.optimizer))
        if self.master is not None:
            forward, update = self.master.stashed()
            return forward, update + state
        return list(self.model.parameters()), state

    def onload(self) -> None:
        """Back from :meth:`offload`: what forward passes read first (the host waits for
        it), then the rest on a side stream while the host goes on (a colocated step's
        log-prob pass hides it); the optimizer step waits for it on the device."""
        if self._forward_stash.released:
            self._forward_stash.restore()
            if self.master is not None:
                self.master.restore_gradients()
        if self._update_stash.released:
            self._update_stash.restore(stream=self._onload_stream)
        self.offloaded = False

    def onload_all(self) -> None:
        """:meth:`onload`, with the current stream waiting for all of it (what reads the
        master weights or the optimizer state outside a training step)."""
        self.onload()
        self._update_stash.ready()
