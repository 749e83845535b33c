"""Stand-in training ranks: the driver-facing API of
:class:`~rl_launcher.roles.train_group.TrainGroup` over one light Ray actor per simulated
node, which hosts that node's ranks (no torch in it: 128 rank actors importing torch would
need ~40 GB here).

The driver side is the real one's: per-rank batches cross Ray to each node actor (as
pickled bytes, so the node actor never unpickles torch tensors; the same bytes as the
real call), one call per node per method, results back in rank order. What a rank does is
modeled by :class:`~rl_launcher.simulated.engine.SimModel` (a train step, a log-prob pass
and a checkpoint shard take set times; a weight sync gathers for ``weight_bytes /
gather_gb_per_s``), except the weight-update requests: rank 0's node sends each bucket's
``/update_weights_from_distributed`` to every engine over HTTP, as
:class:`~rl_launcher.infra.weight_sync.EngineWeightSync` does, and the engines model the
broadcast. :attr:`SimTrainGroup.sent_bytes` counts what went through Ray.

With ``rollout.data_plane: workers`` the per-rank batches are
:class:`~rl_launcher.roles.worker_rows.RankRows` (references to the rollout workers'
objects): they go to the node actor as they are, and it fetches every rank's rows from the
object store (:func:`fetch_rows`, numpy only) before its modeled compute, as a real rank
assembles its batch (``time/rows_fetch``, ``rows/fetched_bytes``); its old log-probs stay
in the node actor's objects (:class:`~rl_launcher.roles.worker_rows.HeldValues`), as a
real rank's do.
"""

import asyncio
import dataclasses
import math
import pickle
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray

from rl_launcher.roles.worker_rows import HeldValues, RankRows
from rl_launcher.simulated.engine import SimModel, rss_bytes

REF_BYTES = 100  # an ObjectRef in a task's arguments: 28-byte id and its owner's address


class SimNode:
    """One simulated node's training ranks (a Ray actor)."""

    def __init__(self, ranks: list[int], model: SimModel):
        self.ranks, self.model = ranks, model

    def rss_bytes(self) -> int:
        return rss_bytes()

    def train_steps(self, payloads: list[list]) -> dict:
        """``payloads[r][m]``: rank r's minibatch m, pickled bytes or (data_plane=workers) a
        RankRows, whose rows each rank fetches from the rollout workers first."""
        entered = time.time()
        fetched = fetch_rows([batch for rank in payloads for batch in rank])
        compute = time.time()
        time.sleep(self.model.train_s * len(payloads[0]))  # one optimizer step per minibatch
        left = time.time()
        return {
            "loss": 0.0,
            "time/train_entered_at": entered,
            "time/train_left_at": left,
            "time/train_compute": left - compute,
            "time/rows_fetch": compute - entered,
            "rows/fetched_bytes": float(fetched),
        }

    def log_probs(self, batches: list, model: str = "actor") -> list:
        """``batches[r]``: rank r's token count, or its RankRows (fetched first, its
        log-probs kept here as a real rank keeps them: the driver gets references)."""
        fetch_rows([b for b in batches if not isinstance(b, int)])
        time.sleep(self.model.log_probs_s)
        return [held(b, model) if isinstance(b, RankRows) else bytes(4 * b) for b in batches]

    def sync_weights(self, engine_urls: list[str], version: str, how: dict) -> dict:
        start = time.perf_counter()
        time.sleep(self.model.weight_bytes / (self.model.gather_gb_per_s * 1e9))
        exported = time.perf_counter() - start
        sent = 0
        if 0 in self.ranks:
            # Ray runs this method beside an event loop of its own: send from another thread
            with ThreadPoolExecutor(1) as pool:
                sent = pool.submit(asyncio.run, self._send(engine_urls, version, how)).result()
        return {
            "sync/bytes": float(sent),
            "time/sync_call": time.perf_counter() - start,
            "time/sync_export": exported,
        }

    async def _send(self, urls: list[str], version: str, how: dict) -> int:
        """Every bucket to every engine at once (one broadcast per bucket); the last
        bucket carries the version."""
        import os

        import aiohttp

        key = os.environ.get("RL_SGLANG_API_KEY", "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        num_buckets = max(1, math.ceil(self.model.weight_bytes / how["bucket_bytes"]))
        bucket_elems = self.model.weight_bytes // num_buckets // 2  # bf16
        async with aiohttp.ClientSession(headers=headers) as session:

            async def post(url, path, body):
                async with session.post(url + path, json=body) as response:
                    response.raise_for_status()

            if how["transport"] == "distributed":
                body = {
                    "master_address": "127.0.0.1",
                    "master_port": 0,
                    "rank_offset": 1,
                    "world_size": len(urls) + 1,
                    "group_name": "weights",
                    "backend": "gloo",
                }
                await asyncio.gather(*(post(u, "/init_weights_update_group", body) for u in urls))
            for bucket in range(num_buckets):
                body = {
                    "names": [f"bucket.{bucket}"],
                    "dtypes": ["bfloat16"],
                    "shapes": [[bucket_elems]],
                    "group_name": "weights",
                }
                if bucket == num_buckets - 1:
                    body["weight_version"] = version
                await asyncio.gather(
                    *(post(u, "/update_weights_from_distributed", body) for u in urls)
                )
        return bucket_elems * 2 * num_buckets * len(urls)

    def save(self, path: str) -> None:
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        time.sleep(self.model.checkpoint_s)
        for rank in self.ranks:
            (directory / f"rank_{rank:05d}.bin").write_bytes(b"simulated shard")

    def noop(self, *args, **kwargs) -> None:
        """empty_cache, update_reference, export_hf: nothing to model."""

    def offload(self) -> None:
        """The node's ranks move their training state to host memory, side by side."""
        time.sleep(self.model.offload_s)

    def onload(self) -> None:
        time.sleep(self.model.onload_s)

    def load(self, path: str) -> int:
        return 0


def held(batch: RankRows, model: str) -> HeldValues:
    """A rank's float32 zeros for ``batch``, kept in the object store, and (the policy's
    pass) its log-prob gap as scalars over its ``gap_seqs`` (0: no real log-probs here)."""
    import numpy as np

    values = np.zeros(batch.num_tokens, dtype=np.float32)
    seqs = batch.gap_seqs or []
    measured = sum(batch.response_lengths[i] for i in seqs)
    gap = (0.0, measured, 0.0) if model == "actor" and measured else None
    return batch.hold(values, gap)


def fetch_rows(batches: list) -> int:
    """Bytes the ranks read from the object store for ``batches`` (RankRows among them;
    the rest pass): each rank's token ids and engine log-probs, and the old and reference
    log-probs it holds, as a real rank assembles its TrainBatch (numpy only: no torch)."""
    total = 0
    for batch in batches:
        if isinstance(batch, RankRows):
            ids, log_probs = batch.fetch()
            total += sum(a.nbytes for a in ids) + sum(a.nbytes for a in log_probs or [])
            for values in (batch.old_log_probs, batch.ref_log_probs):
                if isinstance(values, HeldValues):
                    total += values.read().nbytes
    return total


def payload_bytes(batch) -> int:
    """What handing ``batch`` to Ray serializes on the driver: its pickle, each object
    reference of a RankRows counted as its id (28 bytes) plus its owner's address (~70)."""
    if not isinstance(batch, RankRows):
        return len(pickle.dumps(batch))
    refs = len(batch.tokens_refs) + len(batch.log_probs_refs or [])
    bare = dataclasses.replace(batch, tokens_refs=[None] * batch.num_seqs, log_probs_refs=None)
    for name in ("old_log_probs", "ref_log_probs"):
        values = getattr(bare, name)
        if isinstance(values, HeldValues):  # kept on the rank: a reference and its picks
            bare = dataclasses.replace(bare, **{name: dataclasses.replace(values, ref=None)})
            refs += 1
    return len(pickle.dumps(bare)) + refs * REF_BYTES


class SimTrainGroup:
    """``TrainGroup(spec, placement, slots, ...)``'s stand-in (see the module docstring):
    every rank a data-parallel rank, ranks grouped by the node of their slot."""

    model = SimModel()  # set by rl_launcher.simulated.simulated_roles

    def __init__(
        self, spec, placement, slots, *, num_cpus, num_gpus=0, ranks_per_node=1, inherited_env=None
    ):  # inherited_env: the node actors take no runtime environment of their own
        by_node: dict[str, list[int]] = defaultdict(list)
        for rank, slot in enumerate(slots):
            by_node[placement.node_ids[slot]].append(rank)
        actor = ray.remote(SimNode)
        self.node_ranks = list(by_node.values())
        self.workers = [
            actor.options(
                num_cpus=0, scheduling_strategy=placement.strategy(slots[ranks[0]])
            ).remote(ranks, self.model)
            for ranks in self.node_ranks
        ]
        self.node_ids = [placement.node_ids[slot] for slot in slots]
        self.num_data_ranks = len(slots)
        self.data_ranks = list(range(len(slots)))
        self.turns = None
        self.sent_bytes = 0  # pickled batches handed to Ray since the last take_sent_bytes
        ray.get([w.rss_bytes.remote() for w in self.workers])  # every node's actor is up

    def _per_node(self, per_rank: list) -> list[list]:
        return [[per_rank[r] for r in ranks] for ranks in self.node_ranks]

    def _gather(self, method: str, per_node: list | None = None, **kwargs) -> list:
        """``method`` on every node actor (node n gets ``per_node[n]`` first); results in
        node order."""
        if per_node is None:
            refs = [getattr(w, method).remote(**kwargs) for w in self.workers]
        else:
            refs = [
                getattr(w, method).remote(args, **kwargs)
                for w, args in zip(self.workers, per_node, strict=True)
            ]
        return ray.get(refs)

    def _turn(self, phase: str) -> None:
        """Colocated: the devices go to the ranks (``training``) or the sync (``syncing``),
        as the real group hands them over (:class:`~rl_launcher.infra.colocation.Turns`)."""
        if self.turns is not None:
            getattr(self.turns, phase)()

    def log_probs(self, batches: list, model: str = "actor") -> list:
        import torch

        self._turn("training")
        self.sent_bytes += sum(payload_bytes(b) for b in batches)
        sent = [b if isinstance(b, RankRows) else b.num_tokens for b in batches]
        per_node = self._gather("log_probs", self._per_node(sent), model=model)
        flat = [blob for node in per_node for blob in node]
        return [
            torch.frombuffer(bytearray(blob), dtype=torch.float32)
            if isinstance(blob, bytes)
            else blob  # data_plane=workers: held on the rank
            for blob in flat
        ]

    def train_step(self, batches: list) -> dict:
        return self.train_steps([batches])

    def train_steps(self, parts: list[list]) -> dict:
        self.sent_bytes += sum(payload_bytes(b) for part in parts for b in part)
        per_rank = [[_sent(part[d]) for part in parts] for d in range(self.num_data_ranks)]
        self._turn("training")
        sent = time.time()
        metrics = self._gather("train_steps", self._per_node(per_rank))[0]
        entered, left = metrics.pop("time/train_entered_at"), metrics.pop("time/train_left_at")
        received = time.time()
        return metrics | {
            "time/train_dispatch": entered - sent,
            "time/train_return": received - left,
            "time/train_call": left - entered,
        }

    def take_sent_bytes(self) -> int:
        sent, self.sent_bytes = self.sent_bytes, 0
        return sent

    def sync_weights(self, engine_urls: list[str], version: str, **how) -> dict:
        self._turn("syncing")
        results = self._gather("sync_weights", engine_urls=engine_urls, version=version, how=how)
        return next(r for r, ranks in zip(results, self.node_ranks, strict=True) if 0 in ranks)

    def save(self, path: str) -> None:
        self._gather("save", path=str(Path(path).absolute()))

    def load(self, path: str) -> int:
        return self._gather("load", path=str(Path(path).absolute()))[0]

    def update_reference(self) -> None:
        self._turn("training")
        self._gather("noop")

    def offload(self) -> None:
        self._gather("offload")

    def start_offload(self):
        """The offload started on every node; the returned function waits for it."""
        refs = [w.offload.remote() for w in self.workers]
        return lambda: ray.get(refs)

    def onload(self) -> None:
        self._gather("onload")

    def start_onload(self):
        """The onload started on every node; the returned function waits for it."""
        refs = [w.onload.remote() for w in self.workers]
        return lambda: ray.get(refs)

    def empty_cache(self) -> None:
        self._gather("noop")

    def export_hf(self, path: str) -> None:
        self._gather("noop")

    def rss_bytes(self) -> list[int]:
        return self._gather("rss_bytes")

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)


def _sent(batch):
    """A TrainBatch goes as its pickled bytes (never unpickled: no torch on the node
    actor), a RankRows as itself (the node fetches its rows)."""
    return batch if isinstance(batch, RankRows) else pickle.dumps(batch)
