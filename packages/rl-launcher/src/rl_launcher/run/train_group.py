"""The training actor group: one Ray actor per rank, torch.distributed among them.

Each :class:`TrainWorker` joins a gloo (CPU) or nccl (GPU) group with an explicit rank,
world size and master address, and runs an rl-fsdp :class:`FSDPBackend`. The driver calls
every method on all ranks at once (they are collectives) with each rank's own batch.
Weight sync runs inside the workers: every rank gathers the full tensors, and rank 0
hands them to the engines itself, so weights never travel through Ray.
"""

import asyncio
import dataclasses
import os
from pathlib import Path

import ray

from rl_core.batch import TrainBatch

PRECISIONS = {"float32": "fp32", "bfloat16": "bf16"}


def fsdp_config(config, *, model_dir: Path):
    """The rl-fsdp config of a :class:`~rl_launcher.config.TrainConfig`."""
    from rl_fsdp import FSDPConfig

    algo, opt = config.algorithm, config.optimizer
    if config.model.dtype not in PRECISIONS:
        raise ValueError(
            f"model.dtype={config.model.dtype!r}: the fsdp backend takes float32 or bfloat16"
        )
    return FSDPConfig(
        model_path=str(model_dir), seed=config.seed, device=config.cluster.device,
        precision=PRECISIONS[config.model.dtype], attention="auto",
        activation_checkpointing=config.model.gradient_checkpointing,
        max_tokens_per_micro_batch=config.backend.micro_batch_tokens,
        temperature=config.rollout.temperature or 1.0, mode=config.mode,
        loss_name=algo.policy_loss, clip_low=algo.clip_low, clip_high=algo.clip_high,
        dual_clip=algo.dual_clip, agg_mode=algo.loss_agg_mode, entropy_coef=algo.entropy_coef,
        kl_coef=algo.kl_coef, kl_kind=algo.kl_kind, reference=algo.kl_coef > 0,
        rollout_is=algo.rollout_is_mode if algo.rollout_is_level else None,
        rollout_is_level=algo.rollout_is_level or "token", rollout_is_cap=algo.rollout_is_cap,
        lr=opt.lr, weight_decay=opt.weight_decay, betas=tuple(opt.betas), eps=opt.eps,
        warmup_steps=opt.warmup_steps, lr_decay=opt.schedule, total_steps=config.num_steps,
        min_lr_ratio=opt.min_lr_ratio, max_grad_norm=opt.grad_clip or None,
    )  # fmt: skip


class TrainWorker:
    """One training rank (a Ray actor; see the module docstring)."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, config):
        from rl_fsdp import FSDPBackend, init_distributed

        device = "cuda" if config.device == "cuda" else "cpu"
        dist_info = init_distributed(device=device, rank=rank, world_size=world_size,
                                     master_addr=master_addr, master_port=master_port)  # fmt: skip
        self.rank, self.backend = rank, FSDPBackend(config, dist_info=dist_info)
        self._loop, self._clients = None, {}  # weight sync's event loop and engine clients

    def log_probs(self, batch: TrainBatch, model: str = "actor"):
        """``[N]`` log-probs of this rank's batch, on CPU."""
        return self.backend.compute_log_probs(batch, model=model).cpu()

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self.backend.train_step(batch)

    def train_steps(self, batches: list[TrainBatch]) -> dict[str, float]:
        """One optimizer step per minibatch, in order; later minibatches' metrics win."""
        metrics: dict[str, float] = {}
        for batch in batches:
            metrics |= self.backend.train_step(batch)
        return metrics

    def sync_weights(self, engine_urls: list[str], version: str, how: dict) -> float:
        """Gather full weights (all ranks) and load them into every engine (rank 0).
        ``how``: transport ("tensor" or "disk"), bucket_bytes, disk path. Returns bytes sent."""
        from rl_sglang import transports

        sent, buckets = 0, self.backend.export_weights(bucket_bytes=how["bucket_bytes"])
        if how["transport"] == "disk":
            named = [item for bucket in buckets for item in bucket]
            if self.rank == 0:
                self._on_engines(engine_urls, lambda clients: transports.update_from_disk(
                    clients, named, how["path"], weight_version=version))  # fmt: skip
            return float(sum(t.numel() * t.element_size() for _, t in named))
        for bucket in buckets:
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
            if self.rank == 0:
                self._on_engines(engine_urls, lambda clients, b=bucket: transports.update_from_tensor(
                    clients, b, weight_version=version))  # fmt: skip
        return float(sent)

    def _on_engines(self, urls: list[str], work):
        """Run ``work(clients)`` on this worker's own event loop, whose clients (and their
        keep-alive connections) live as long as the worker instead of one sync."""
        from rl_sglang.client import EngineClient

        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        clients = [self._clients.setdefault(url, EngineClient(url)) for url in urls]
        return self._loop.run_until_complete(work(clients))

    def save(self, path: str) -> None:
        self.backend.save_checkpoint(Path(path))

    def load(self, path: str) -> int:
        self.backend.load_checkpoint(Path(path))
        return self.backend.step


def cpu_threads_env(ranks_per_node: int) -> dict:
    """Ray starts an actor with OMP_NUM_THREADS=num_cpus (1 by default), which also pins
    oneDNN/MKL to one thread; on CPU the node's cores belong to its training ranks (a
    colocated engine waits while they train), so each rank gets its share."""
    threads = max(1, (os.cpu_count() or 1) // max(1, ranks_per_node))
    return {"env_vars": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}}


class TrainGroup:
    """``num_ranks`` :class:`TrainWorker` actors, rank r in placement slot ``slots[r]``."""

    def __init__(self, config, placement, slots, *, num_cpus: float, num_gpus: float = 0,
                 ranks_per_node: int = 1):  # fmt: skip
        from rl_fsdp import free_port

        addr = ray.util.get_node_ip_address() if config.device == "cuda" else "127.0.0.1"
        port, world = free_port(addr), len(slots)
        actor = ray.remote(TrainWorker)
        env = cpu_threads_env(ranks_per_node) if config.device != "cuda" else {}
        self.workers = [
            actor.options(num_cpus=num_cpus, num_gpus=num_gpus, runtime_env=env,
                          scheduling_strategy=placement.strategy(slot)).remote(
                rank, world, addr, port, config)
            for rank, slot in enumerate(slots)
        ]  # fmt: skip

    def call(self, method: str, *per_rank_args, **shared) -> list:
        """``method`` on every rank (rank r gets ``per_rank_args[i][r]``), results in rank order."""
        refs = [
            getattr(worker, method).remote(*(args[r] for args in per_rank_args), **shared)
            for r, worker in enumerate(self.workers)
        ]
        return ray.get(refs)

    def log_probs(self, batches: list[TrainBatch], model: str = "actor") -> list:
        return self.call("log_probs", batches, model=model)

    def train_step(self, batches: list[TrainBatch]) -> dict[str, float]:
        return self.call("train_step", batches)[0]  # metrics are already summed over ranks

    def train_steps(self, parts: list[list[TrainBatch]]) -> dict[str, float]:
        """``parts[m][r]``: minibatch m of rank r; one remote call per rank for all of them."""
        per_rank = [[part[r] for part in parts] for r in range(len(self.workers))]
        return self.call("train_steps", per_rank)[0]

    def sync_weights(self, engine_urls: list[str], version: str, **how) -> float:
        return self.call("sync_weights", engine_urls=engine_urls, version=version, how=how)[0]

    def save(self, path: str) -> None:
        self.call("save", path=path)

    def load(self, path: str) -> int:
        return self.call("load", path=path)[0]

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)


def with_old_log_probs(batches: list[TrainBatch], log_probs: list) -> list[TrainBatch]:
    return [
        dataclasses.replace(b, old_log_probs=lp) for b, lp in zip(batches, log_probs, strict=True)
    ]
