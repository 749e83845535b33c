"""The training actor group: one Ray actor per rank, torch.distributed among them.

Each :class:`TrainWorker` joins a gloo (CPU) or nccl (GPU) group with an explicit rank and
world size, meeting at rank 0's node on a port rank 0 holds there
(:mod:`rl_launcher.infra.rendezvous`), and runs the configured backend (rl-fsdp's
``FSDPBackend`` or rl-megatron's ``MegatronBackend``, see :mod:`rl_launcher.roles.backends`).
The driver calls every method on all ranks at once (they are collectives); a step is split
into one batch per data-parallel rank, and ranks of one data-parallel rank (Megatron's
TP / PP / CP peers) get the same batch. Weight sync runs inside the workers: every rank
gathers the full tensors, and rank 0 hands them to the engines itself
(:mod:`rl_launcher.infra.weight_sync`), so weights never travel through Ray.
"""

import dataclasses
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import ray

from rl_core.batch import TrainBatch
from rl_launcher.infra import faults
from rl_launcher.infra.gc_pauses import GcPauses, freeze_startup
from rl_launcher.infra.rendezvous import GroupMember, meet, spans_nodes
from rl_launcher.roles.backends import BackendSpec, fsdp_config  # noqa: F401  (re-exported)
from rl_launcher.roles.worker_rows import RankRows, as_train_batch, log_prob_gap


class TimedIter:
    """Iterates ``items``, summing in ``seconds`` the time spent waiting for each one."""

    def __init__(self, items):
        self.items, self.seconds = iter(items), 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self.items)
        finally:
            self.seconds += time.perf_counter() - start


class TrainWorker(GroupMember):
    """One training rank (a Ray actor; see the module docstring). ``run_spans_nodes``:
    the run's engines may be on other nodes than rank 0 (the weight-update group then
    meets at rank 0's node address, not on loopback)."""

    def __init__(self, rank: int, world_size: int, spec: BackendSpec, run_spans_nodes: bool):
        self.rank, self.world_size, self.spec = rank, world_size, spec
        self.run_spans_nodes, self.offloaded = run_spans_nodes, False
        self.busy_s: dict[str, float] = defaultdict(float)  # time in the backend, by part

    def join(self, host: str, port: int) -> None:
        """Join the group at rank 0's ``host:port``, then build the backend."""
        from rl_launcher.infra.rendezvous import rendezvous_host
        from rl_launcher.infra.weight_sync import EngineWeightSync
        from rl_launcher.roles.backends import build_backend

        # rank 0's weight-update address first: a bad interface fails before any collective
        sync_host = rendezvous_host(self.run_spans_nodes) if self.rank == 0 else None
        self.join_group(self.spec.device, host, port)
        self.backend = build_backend(
            self.spec,
            rank=self.rank,
            world_size=self.world_size,
            master_addr=host,
            master_port=port,
        )
        self.weights = EngineWeightSync(self.rank, master_address=sync_host)
        freeze_startup()  # a full collection mid-step would leave the GPU waiting
        self.gc_pauses = GcPauses()

    def weight_sync_address(self) -> tuple[str, int | None]:
        """Rank 0: where it hosts the weight-update group (the port once the first
        ``distributed`` sync made the group)."""
        return self.weights.address()

    def data_rank(self) -> int:
        return self.backend.data_rank

    def log_probs(self, batch: TrainBatch, model: str = "actor"):
        """``[N]`` log-probs of this rank's batch, on CPU. A RankRows (rollout.data_plane=
        workers) is fetched from the workers, and its log-probs stay here: the driver gets
        them by reference, with the rank's log-prob gap (the policy's pass only)."""
        self.onload()
        rows = batch if isinstance(batch, RankRows) else None
        batch = as_train_batch(batch)
        start = time.perf_counter()
        log_probs = self.backend.compute_log_probs(batch, model=model).cpu()
        self.busy_s["log_probs_compute"] += time.perf_counter() - start
        if rows is None:
            return log_probs
        gap = log_prob_gap(batch, log_probs, rows.gap_seqs) if model == "actor" else None
        return rows.hold(log_probs.float().numpy(), gap)

    def update_reference(self) -> None:
        """The KL reference becomes the policy as it is now (algorithm.ref_update_interval)."""
        self.onload()
        self.backend.update_reference()

    def train_steps(self, batches: list[TrainBatch]) -> dict[str, float]:
        """One optimizer step per minibatch, in order; later minibatches' metrics win.
        Also ``time/<part>``: this rank's seconds inside the backend since the last call
        (``log_probs_compute``, ``train_compute``) and moving state back (``onload``)."""
        entered = time.time()  # wall clock, comparable with the driver's on one node
        self.onload()
        batches = [as_train_batch(b) for b in batches]  # data_plane=workers: fetched here
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        for batch in batches:
            metrics = faults.merge_minibatch_metrics(
                metrics, self.backend.train_step(batch)
            )  # skipped (non-finite) minibatches are counted, not overwritten
        metrics = {key: float(value) for key, value in metrics.items()}  # no device tensors
        metrics["time/trainer_gc"] = self.gc_pauses.take()["time/gc"]
        _wait_for_device()  # the last optimizer step's kernels count as compute
        self.busy_s["train_compute"] += time.perf_counter() - start
        stamps = {"time/train_entered_at": entered, "time/train_left_at": time.time()}
        return metrics | self.take_busy_times() | stamps

    def take_busy_times(self) -> dict[str, float]:
        times, self.busy_s = dict(self.busy_s), defaultdict(float)
        return {f"time/{part}": seconds for part, seconds in times.items()}

    def sync_weights(self, engine_urls: list[str], version: str, how: dict) -> dict:
        """Gather full weights (all ranks) and load them into every engine (rank 0).
        ``how``: see :func:`rl_launcher.infra.weight_sync.sync_options`. Returns the bytes
        sent (``sync/bytes``), this rank's wall time in the call (``time/sync_call``) and
        the part of it spent producing the buckets (``time/sync_export``: gathering and
        casting in the backend, and with ``engine.quantization: fp8`` quantising; the rest
        is packing and handing them to the engines)."""
        if how.get("lora_sync") == "adapter":  # the LoRA adapters alone (roles/lora.py)
            return self.adapter_sync(engine_urls, version, how)
        from rl_launcher.infra.weight_sync import quantized_buckets

        start = time.perf_counter()
        self.onload()
        exported = self.backend.export_weights(bucket_bytes=how["bucket_bytes"])
        buckets = TimedIter(quantized_buckets(exported, how))  # engine.quantization: fp8
        sent = self.weights.sync(buckets, engine_urls, version, how)
        return {
            "sync/bytes": sent,
            "time/sync_call": time.perf_counter() - start,
            "time/sync_export": buckets.seconds,
        }

    def engines_fed(self) -> list[str]:
        """The engines this rank handed the last sync to (each node's sender feeds its
        node's engines with ``tensor``; rank 0 feeds them all otherwise)."""
        return self.weights.fed

    def adapter_sync(self, engine_urls: list[str], version: str, how: dict) -> dict:
        from rl_launcher.roles.lora import AdapterSync

        self.onload()
        if getattr(self, "adapters", None) is None:
            self.adapters = AdapterSync(self.rank)
        return self.adapters.sync(self.backend, engine_urls, version, how)

    def offload(self) -> None:
        """Training state to host memory (colocated engines generate meanwhile)."""
        if not self.offloaded:
            # kept send buffers stay (at most 2 x engine.weight_bucket_bytes): the engines
            # keep their handles open, so the next sync opens nothing and packs in place
            self.backend.offload()
            self.offloaded = True
        self.empty_cache()  # the engines need the cached blocks back

    def release_weight_buffers(self) -> None:
        self.weights.release_buffers()

    def empty_cache(self) -> None:
        """Cached device blocks back to the driver (colocated engines resume into them)."""
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def onload(self) -> None:
        if self.offloaded:
            start = time.perf_counter()
            self.backend.onload()
            self.offloaded = False
            self.busy_s["onload"] += time.perf_counter() - start

    def save(self, path: str) -> None:
        self.onload()
        self.backend.save_checkpoint(Path(path))

    def load(self, path: str) -> int:
        self.onload()
        self.backend.load_checkpoint(Path(path))
        return self.backend.step

    def export_hf(self, path: str) -> None:
        """A Hugging Face directory of the current weights (collective; rank 0 writes)."""
        self.onload()
        self.backend.export_hf(Path(path))


def _wait_for_device() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def cpu_threads_env(ranks_per_node: int, threads: str | None = None) -> dict:
    """Ray starts an actor with OMP_NUM_THREADS=num_cpus (1 by default), which also pins
    oneDNN/MKL to one thread; on CPU the node's cores belong to its training ranks (a
    colocated engine waits while they train), so each rank gets its share. ``threads``
    (the OMP_NUM_THREADS rl-train was started with) is every rank's instead: a tiny model
    on a busy 2-core machine trained several times faster on one thread than on two."""
    threads = threads or str(max(1, (os.cpu_count() or 1) // max(1, ranks_per_node)))
    return {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}}


def without_inherited(env: dict, inherited: dict | None) -> dict | None:
    """``env`` less the variables that the workers inherit with these values anyway
    (``inherited``: the environment a local Ray was started with, which its workers get),
    or None when nothing is left: an actor with a ``runtime_env`` gets a fresh worker
    process of its own (Ray's setup, then importing ray: about 1 s on a busy 2-core CPU,
    on the start-up's critical path), one without takes a worker Ray started beforehand."""
    if inherited is None:  # attached to a cluster: its workers never saw our environment
        return env or None
    kept = {k: v for k, v in env.get("env_vars", {}).items() if inherited.get(k) != v}
    rest = {k: v for k, v in env.items() if k != "env_vars"}
    return ({"env_vars": kept} if kept else {}) | rest or None


def with_import_path(env: dict) -> dict:
    """``env`` with the run's PYTHONPATH (config/extensions.py: the working directory and the
    config's directory first), so a rank imports the dotted paths the driver checked."""
    from rl_launcher.config.extensions import import_path_env

    extra = import_path_env()
    if not extra:
        return env
    return {**env, "env_vars": {**env.get("env_vars", {}), **extra}}


class TrainGroup:
    """``num_ranks`` :class:`TrainWorker` actors, rank r in placement slot ``slots[r]``.

    Per-rank arguments are given per data-parallel rank (``num_data_ranks`` of them);
    per-rank results come back the same way. ``address``: where the ranks met (rank 0's
    node, loopback when all ranks share it); ``node_ids[r]``: rank r's Ray node.
    ``inherited_env``: the environment of the local Ray this process started (None when
    Ray runs elsewhere), see :func:`without_inherited`."""

    def __init__(
        self,
        spec: BackendSpec,
        placement,
        slots,
        *,
        num_cpus: float,
        num_gpus: float = 0,
        ranks_per_node: int = 1,
        inherited_env: dict | None = None,
    ):
        actor, world = ray.remote(TrainWorker), len(slots)
        threads = os.environ.get("OMP_NUM_THREADS")  # the user's, if set
        env = cpu_threads_env(ranks_per_node, threads) if spec.device != "cuda" else {}
        env = with_import_path(env)  # user losses by dotted path import in the ranks too
        env = without_inherited(env, inherited_env)
        run_spans_nodes = len(set(placement.node_ids)) > 1
        self.workers = [
            actor.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                runtime_env=env,
                scheduling_strategy=placement.strategy(slot),
            ).remote(rank, world, spec, run_spans_nodes)
            for rank, slot in enumerate(slots)
        ]
        self.node_ids = [placement.node_ids[slot] for slot in slots]
        self.address = meet(self.workers, spans_nodes=spans_nodes(placement, slots))
        self.data_ranks = ray.get([w.data_rank.remote() for w in self.workers])
        self.num_data_ranks = spec.data_parallel
        self.turns = None  # a colocation.Turns when trainer and engines share GPUs
        self._lock = threading.Lock()
        assert sorted(set(self.data_ranks)) == list(range(self.num_data_ranks)), self.data_ranks

    def call(self, method: str, *per_rank_args, **shared) -> list:
        """``method`` on every rank (rank r gets ``per_rank_args[i][data_rank(r)]``);
        results in rank order."""
        with self._lock:  # calls from two threads (an engine restore) never interleave
            refs = self._submit(method, *per_rank_args, **shared)
            # a dead rank raises at once, named with its node
            return faults.gather(refs, method=method, where=self.where)

    def call_meanwhile(self, method: str) -> Callable[[], list]:
        """Start ``method`` on every rank and return at once; the returned function waits
        for it (results in rank order). Each rank runs its calls in order, so a later
        call starts after this one on every rank."""
        with self._lock:
            refs = self._submit(method)
        return lambda: faults.gather(refs, method=method, where=self.where)

    def _submit(self, method: str, *per_rank_args, **shared) -> list:
        return [
            getattr(worker, method).remote(
                *(args[self.data_ranks[r]] for args in per_rank_args), **shared
            )
            for r, worker in enumerate(self.workers)
        ]

    def where(self, rank: int, error: BaseException) -> str:
        """Rank ``rank``'s node, in words (said when its actor dies of ``error``)."""
        return faults.describe_node(self.node_ids[rank], error)

    def per_data_rank(self, results: list) -> list:
        """One result per data-parallel rank (its first rank's)."""
        return [results[self.data_ranks.index(d)] for d in range(self.num_data_ranks)]

    def _turn(self, phase: str) -> None:
        if self.turns is not None:
            getattr(self.turns, phase)()

    def log_probs(self, batches: list[TrainBatch], model: str = "actor") -> list:
        self._turn("training")
        return self.per_data_rank(self.call("log_probs", batches, model=model))

    def train_step(self, batches: list[TrainBatch]) -> dict[str, float]:
        """One optimizer step on ``batches[d]`` per data rank (metrics summed over ranks)."""
        return self.train_steps([batches])

    def train_steps(self, parts: list[list[TrainBatch]]) -> dict[str, float]:
        """``parts[m][d]``: minibatch m of data rank d; one remote call per rank for all."""
        per_rank = [[part[d] for part in parts] for d in range(self.num_data_ranks)]
        self._turn("training")
        sent = time.time()
        metrics = self.call("train_steps", per_rank)[0]
        return metrics | call_latency(metrics, sent=sent, received=time.time())

    def update_reference(self) -> None:
        self._turn("training")
        self.call("update_reference")

    def sync_weights(self, engine_urls: list[str], version: str, **how) -> dict:
        self._turn("syncing")
        return self.call("sync_weights", engine_urls=engine_urls, version=version, how=how)[0]

    def offload(self) -> None:
        self.call("offload")

    def start_offload(self) -> Callable[[], list]:
        """Every rank starts moving its training state to host memory; the returned
        function waits for them (colocated engines generate meanwhile)."""
        return self.call_meanwhile("offload")

    def onload(self) -> None:
        self.call("onload")

    def start_onload(self) -> Callable[[], list]:
        """Every rank starts moving its training state back to the device; the returned
        function waits for them (the driver builds the step's batches meanwhile)."""
        return self.call_meanwhile("onload")

    def empty_cache(self) -> None:
        self.call("empty_cache")

    # Paths go to the ranks absolute: a relative one would be taken from each rank's own
    # working directory, which on another node is not the driver's.
    def save(self, path: str) -> None:
        self.call("save", path=str(Path(path).absolute()))

    def load(self, path: str) -> int:
        return self.call("load", path=str(Path(path).absolute()))[0]

    def export_hf(self, path: str) -> None:
        self.call("export_hf", path=str(Path(path).absolute()))

    def shutdown(self) -> None:
        """Kill the ranks, each after letting go of its kept weight-sync buffers: Ray kills
        torch's shared-memory manager with a rank, and a rank killed holding a CPU buffer
        would leave its file in /dev/shm."""
        releases = [worker.release_weight_buffers.remote() for worker in self.workers]
        ray.wait(releases, num_returns=len(releases), timeout=5)
        for worker in self.workers:
            ray.kill(worker)


def call_latency(metrics: dict, *, sent: float, received: float) -> dict[str, float]:
    """Rank 0's entry and exit stamps (popped from ``metrics``) as the time the call took
    to reach the worker (``time/train_dispatch``: Ray scheduling, argument transfer) and
    to come back (``time/train_return``), and the worker's own wall time in the call
    (``time/train_call``); on one node both clocks are the same."""
    entered, left = metrics.pop("time/train_entered_at"), metrics.pop("time/train_left_at")
    return {
        "time/train_dispatch": entered - sent,
        "time/train_return": received - left,
        "time/train_call": left - entered,  # the worker's wall time in the call
    }


def with_old_log_probs(batches: list[TrainBatch], log_probs: list) -> list[TrainBatch]:
    return [
        dataclasses.replace(b, old_log_probs=lp) for b, lp in zip(batches, log_probs, strict=True)
    ]
