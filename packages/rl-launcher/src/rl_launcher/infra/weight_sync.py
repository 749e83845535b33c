"""How trained weights reach the engines, chosen per placement.

- ``tensor``: tensor handles (CUDA IPC on GPU, shared memory on CPU) into colocated engines.
  Handles do not cross nodes, so each engine is fed by a training rank on its own node:
  the lowest rank there (:func:`engine_senders`; ``how["senders"]``, engine -> rank). A
  node with engines and no training rank is refused at start-up.
- ``disk``: an HF safetensors directory the engines load (``engine.weight_sync_dir``,
  else ``<run_dir>/sync_weights``); written by training rank 0 and read by every engine,
  so on a run over several nodes it must be on storage they share (checked at start-up,
  :mod:`rl_launcher.infra.shared_dirs`).
- ``distributed``: a process group between training rank 0 and every engine
  (``/init_weights_update_group`` once, then ``/update_weights_from_distributed`` and a
  broadcast per bucket): gloo on CPU, nccl on GPU. For disaggregated layouts. Rank 0
  hosts the group's store on its own node (loopback when the whole run is on one node,
  else its node's address: :func:`rl_launcher.infra.rendezvous.rendezvous_host`).
- ``auto``: ``tensor`` when colocated, ``distributed`` when disaggregated.

:func:`sync_options` (driver) resolves the choice; :class:`EngineWeightSync` (inside each
training rank) carries the buckets: every rank gathers the full tensors; rank 0 sends,
or with ``tensor`` each node's sending rank to its node's engines.
"""

import asyncio
import threading
from pathlib import Path

TRANSPORTS = ("tensor", "disk", "distributed")
SEND_SLOTS = 2  # kept send buffers per rank: one being applied, one being packed


def resolve_transport(weight_sync: str, *, colocate: bool, device: str) -> str:
    """The transport of ``engine.weight_sync`` for this placement."""
    if weight_sync == "auto":
        return "tensor" if colocate else "distributed"
    if weight_sync not in TRANSPORTS:
        raise ValueError(
            f"engine.weight_sync={weight_sync!r}; choose auto, {', '.join(TRANSPORTS)}"
        )
    if weight_sync == "tensor" and not colocate and device == "cuda":
        raise ValueError(
            "engine.weight_sync=tensor hands CUDA IPC handles to engines on the trainer's GPU; "
            "with cluster.colocate=false use distributed (or auto)"
        )
    return weight_sync


def engine_senders(engine_nodes: list, rank_nodes: list, transport: str) -> list[int]:
    """The training rank that hands each engine its weights: with ``tensor``, the lowest
    rank on the engine's node (``engine_nodes[e]``, ``rank_nodes[r]``: Ray node ids); with
    the other transports rank 0. ValueError naming the engines when a node has none."""
    if transport != "tensor":
        return [0] * len(engine_nodes)
    lowest = {}
    for rank, node in enumerate(rank_nodes):
        lowest.setdefault(node, rank)
    alone = [e for e, node in enumerate(engine_nodes) if node not in lowest]
    if alone:
        raise ValueError(
            f"engine.weight_sync=tensor hands tensor handles to engines from a training rank "
            f"on their own node, and engines {alone} are on nodes without one; set "
            "engine.weight_sync to distributed, or disk on storage every node shares"
        )
    return [lowest[node] for node in engine_nodes]


def urls_of_rank(urls: list[str], rank: int, how: dict) -> list[str]:
    """The engines ``rank`` hands the weights to (``how["senders"]``: engine -> rank;
    without it, rank 0 feeds them all)."""
    senders = how.get("senders") or [0] * len(urls)
    return [url for url, sender in zip(urls, senders, strict=True) if sender == rank]


def engine_tp_ranks(engine_bundles, train_bundles) -> list[list[int]]:
    """For each engine, the training rank sharing each of its devices, in the engine's TP
    order: an engine of TP size t gets t payloads, and SGLang's TP rank j opens the one of
    the rank on its own GPU. Empty when some engine device has no training rank (then every
    TP rank gets the sender's payload)."""
    rank_of = {bundle: rank for rank, bundle in enumerate(train_bundles)}
    if not all(b in rank_of for bundles in engine_bundles for b in bundles):
        return []
    return [[rank_of[b] for b in bundles] for bundles in engine_bundles]


def payloads_of_sender(shared: list, urls: list[str], tp_ranks: list, rank: int) -> dict:
    """The engines ``rank`` feeds (those whose first device is its own), each with its TP
    ranks' payloads: ``shared[r]`` is rank r's ``(payload, bucket names)``. RuntimeError
    when the ranks hold different buckets (pipeline stages export different tensors)."""
    if any(names != shared[0][1] for _, names in shared):
        raise RuntimeError(
            "colocated tensor sync into multi-GPU engines needs the same bucket on every "
            "training rank (pipeline stages export different tensors); set "
            "engine.weight_sync to disk or distributed"
        )
    return {
        url: [shared[r][0] for r in ranks]
        for url, ranks in zip(urls, tp_ranks, strict=True)
        if ranks[0] == rank
    }


def sync_dir(config, run_dir: Path) -> Path:
    """The directory of disk weight sync, absolute (the engines resolve it elsewhere)."""
    return Path(config.engine.weight_sync_dir or Path(run_dir) / "sync_weights").absolute()


def sync_options(config, run_dir: Path) -> dict:
    """What every training rank needs to push weights (a plain dict: it crosses Ray)."""
    engine, device = config.engine, config.cluster.device
    transport = resolve_transport(
        engine.weight_sync, colocate=config.cluster.colocate, device=device
    )
    return {
        "transport": transport,
        "bucket_bytes": engine.weight_bucket_bytes,
        "path": str(sync_dir(config, run_dir)),
        "engine_kind": engine.kind,
        "group_backend": "nccl" if device == "cuda" else "gloo",
        "tp_size": engine.devices_per_engine,
        "flatten": engine.weight_flatten,
        "buffer": engine.weight_buffer,  # tensor: kept send buffers, or fresh per bucket
        "quantization": engine.quantization,  # fp8: buckets quantised on the way (rl_core.fp8)
        "lora_sync": config.model.lora_sync if config.model.lora_rank else None,  # roles/lora
    }


class EngineWeightSync:
    """A training rank's side of weight sync. Its event loop (on a thread of its own, so
    that a request is in flight while this thread packs the next bucket), engine clients
    (keep-alive connections), kept send buffers and, for ``distributed``, the process
    group live as long as the rank. ``master_address``: where rank 0 hosts the
    weight-update group (its node)."""

    def __init__(self, rank: int, *, master_address: str | None = None):
        self.rank, self._loop, self._clients, self._sender = rank, None, {}, None
        self.master_address = master_address
        self.fed: list[str] = []  # the engines this rank sent the last sync to
        self.buffers: list = []  # kept send buffers (rl_sglang.transports.SendBuffer)

    def address(self) -> tuple[str, int | None]:
        """Where this rank hosts the weight-update group: host, and port once it exists."""
        port = self._sender.master_port if self._sender is not None else None
        return self.master_address or "127.0.0.1", port

    def sync(self, buckets, urls: list[str], version: str, how: dict) -> float:
        """Push every bucket of ``(hf_name, tensor)`` to this rank's engines (every rank
        takes part: gathering the buckets is collective); returns the bytes sent."""
        sent, self.fed = 0.0, urls_of_rank(urls, self.rank, how)
        if how["transport"] == "disk":
            named = [item for bucket in buckets for item in bucket]
            if self.fed:
                self._run(self._to_disk(self.fed, named, how["path"], version))
            return float(sum(t.numel() * t.element_size() for _, t in named))
        per_device = how["transport"] == "tensor" and max(map(len, how.get("tp_ranks") or [[]])) > 1
        if kept_buffers(how) and not per_device:
            return self._stream_kept(buckets, version, how)
        for bucket in buckets:
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
            if per_device:
                self._send_per_device(urls, bucket, version, how)
            elif self.fed:
                self._run(self._send(self.fed, bucket, version, how))
        return sent

    def _stream_kept(self, buckets, version: str, how: dict) -> float:
        """``tensor`` through kept send buffers, two of them in turn: bucket k+1 is made
        (gathered by the backend) and packed into one while the engines apply bucket k
        from the other; bucket k+1 is sent once k is answered, so a buffer is refilled
        only after the engines have copied out of it."""
        from rl_sglang import transports

        sent, in_flight = 0.0, None
        for index, bucket in enumerate(buckets):
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
            if not self.fed:
                continue
            packed = self._buffer(index % SEND_SLOTS).fill(bucket)
            payloads = transports.payloads_per_receiver(packed, len(self.fed), how["tp_size"])
            if in_flight is not None:
                in_flight.result()
            send = transports.send_payloads(
                self.clients(self.fed), payloads, flatten=True, weight_version=version
            )
            in_flight = self._submit(send)
        if in_flight is not None:
            in_flight.result()
        return sent

    def _buffer(self, slot: int):
        from rl_sglang.transports import SendBuffer

        while len(self.buffers) <= slot:
            self.buffers.append(SendBuffer())
        return self.buffers[slot]

    def release_buffers(self) -> None:
        """Free the kept send buffers (at shutdown; a later sync would allocate them
        again). They are kept through colocated turns: the engines hold their handles."""
        for buffer in self.buffers:
            buffer.release()

    def _send_per_device(self, urls, bucket, version, how):
        """Colocated engines spanning several GPUs: every rank shares its copy of the bucket
        (tensor handles on its own GPU), and each engine's sender hands TP rank j the
        handles of the training rank on that rank's GPU. Collective over the training ranks:
        the barrier keeps every rank's copy alive until the engines have loaded it."""
        import torch.distributed as dist

        from rl_sglang import transports

        payload, keep_alive = transports.serialize_bucket(bucket, flatten=how["flatten"])
        shared = [None] * dist.get_world_size()
        dist.all_gather_object(shared, (payload, [name for name, _ in bucket]))
        mine = payloads_of_sender(shared, urls, how["tp_ranks"], self.rank)
        if mine:
            self._run(
                transports.send_payloads(
                    self.clients(list(mine)),
                    list(mine.values()),
                    flatten=how["flatten"],
                    weight_version=version,
                )
            )
        dist.barrier()
        del keep_alive

    async def _to_disk(self, urls, named, path, version):
        from rl_sglang import transports

        await transports.update_from_disk(self.clients(urls), named, path, weight_version=version)

    async def _send(self, urls, bucket, version, how):
        from rl_sglang import transports

        if how["transport"] == "tensor":
            await transports.update_from_tensor(
                self.clients(urls),
                bucket,
                weight_version=version,
                tp_size=how["tp_size"],
                flatten=how["flatten"],
            )
            return
        sender = await self._connected_sender(urls, how)
        await sender.send(bucket, weight_version=version, flatten=how["flatten"])

    async def _connected_sender(self, urls, how):
        """The process group with the engines, joined on the first sync."""
        if self._sender is None:
            self._sender = make_sender(self.clients(urls), how, self.master_address)
            await self._sender.connect()
        return self._sender

    def clients(self, urls: list[str]) -> list:
        from rl_sglang.client import EngineClient

        return [self._clients.setdefault(url, EngineClient(url)) for url in urls]

    def _run(self, work):
        return self._submit(work).result()

    def _submit(self, work):
        """Schedule the coroutine ``work`` on the rank's event-loop thread; a Future."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            name = f"weight-sync-{self.rank}"
            threading.Thread(target=self._loop.run_forever, name=name, daemon=True).start()
        return asyncio.run_coroutine_threadsafe(work, self._loop)


def quantized_buckets(buckets, how: dict):
    """The buckets as the engines take them: with ``engine.quantization: fp8`` each one's
    linear weights become FP8 plus their ``weight_scale_inv`` (:mod:`rl_core.fp8`), on the
    device they were gathered on; else unchanged."""
    if how.get("quantization", "none") != "fp8":
        return buckets
    from rl_core.fp8 import quantize_named

    return (list(quantize_named(bucket)) for bucket in buckets)


def kept_buffers(how: dict) -> bool:
    """``tensor`` sync of flattened buckets through send buffers kept for the run
    (``engine.weight_buffer: kept``)."""
    kept = how.get("buffer", "kept") == "kept"
    return how["transport"] == "tensor" and how["flatten"] and kept


def make_sender(clients: list, how: dict, master_address: str | None = None):
    """rl-sglang's sender: its group is built the way SGLang's engines build their end, so
    it serves embedded engines and real SGLang alike (an engine of TP size t takes t ranks).
    Its store listens on ``master_address`` only (loopback when None)."""
    from rl_sglang.transports import DistributedWeightSender

    tp_size = how["tp_size"] if how["engine_kind"] == "sglang" else 1
    return DistributedWeightSender(
        clients,
        master_address=master_address or "127.0.0.1",
        backend=how["group_backend"],
        tp_size=tp_size,
    )
