"""``rollout.data_plane: workers``: the samples' token data stays beside the engines.

With the default data plane (``driver``) every generated token passes through the driver
process: the engines' JSON into Samples, the buffer's tensors, per-rank batches pickled into
Ray (docs/scale.md measured ~4-6 us of the driver's serial CPU a token). Here:

    driver                                     rollout worker (one per node with engines)
    draws the step's prompts, deals them  ->   generates them through the router, scores
                                               them, puts each group's ids and log-probs
                                               into the object store (worker_rows.py)
    groups, filters, advantages, metrics  <-   one SampleRow per sample: no token lists
    per-rank RankRows (references, rows,
    advantages per response token)        ->   training rank r fetches its rows from the
                                               workers' nodes (RankRows.to_train_batch)

The step is the driver path's: same prompts (drawn and remembered here for checkpoints),
same samples for the same seed (each prompt's requests carry their own sampling seed), same
rewards, advantages, per-rank split and loss. The trainer's old and reference log-probs
stay on the ranks that computed them, and the log-prob gap metric comes back as each
rank's scalars (:class:`~rl_launcher.roles.worker_rows.HeldValues`). In the asynchronous
loop each worker generates the producer's chunks of its share and holds the groups a
weight update paused until the next chunk resumes them (:meth:`WorkerRollout.generate`).
Pieces that read token data on the driver are refused before Ray starts
(:func:`rl_launcher.config.data_plane_checks.check_data_plane`) rather than given empty
samples. Left on the driver: the advantages (4 bytes a response token, computed there: 2-4 %
of the driver's step CPU at 64 simulated GPUs, docs/scale.md) go to the ranks with the
batches.
"""

import asyncio
import os
from dataclasses import dataclass, field

from rl_core.advantages import AdvantageInputs
from rl_core.packing import balanced_partitions
from rl_core.types import Sample, SampleStatus, scalar_reward
from rl_launcher.data.buffer import DataBuffer, StepBatch
from rl_launcher.roles.worker_rows import RankRows, SampleRow, group_objects, sample_row

# rl-sglang's rollout metrics that are means over the kept samples; the rest are counts
MEANS = ("rollout/truncated_frac", "rollout/response_length_mean")


@dataclass
class WorkerOutput:
    """One worker's share of a rollout: groups that finished (``kept``) and groups with an
    aborted sample (``left``: the buffer counts and drops them, as on the driver path; in
    the asynchronous loop's chunks the worker holds those a pause aborted, see ``held``)."""

    kept: list[list[SampleRow]]
    left: list[list[SampleRow]]
    metrics: dict[str, float]
    reward_counts: dict[str, int]
    held: list[int] = field(default_factory=list)  # draws of the groups the worker holds


class RolloutWorker:
    """One node's rollout worker (an async Ray actor): rl-sglang's default rollout of the
    prompts it is dealt, through ``url`` (the router), scored by the run's reward."""

    def __init__(self, config, tokenizer, url: str, api_key: str | None):
        from rl_launcher.roles.reward import load_run_reward

        self.config, self.tokenizer, self.url, self.api_key = config, tokenizer, url, api_key
        self.reward = load_run_reward(config, tokenizer)  # reward processes start here
        self.client = None
        self.held: dict[int, list[Sample]] = {}  # draw -> a group a pause aborted (async)

    def ready(self) -> bool:
        return True

    async def rollout(
        self, templates: list[Sample], sampling_params: dict, resume: tuple[int, ...] = ()
    ) -> WorkerOutput:
        """``group_size`` scored samples of each prompt of ``templates``, stored. ``resume``
        (the asynchronous loop's chunks): draws of groups this worker holds, generated first
        (their partial responses go on with ``rollout.partial_rollout``, else restart); groups
        a pause aborts then stay here for the next chunk (:attr:`WorkerOutput.held`)."""
        from rl_launcher.roles.async_rollout import failed, restart
        from rl_launcher.roles.default_rollout import relabel, rollout_settings
        from rl_sglang.client import EngineClient
        from rl_sglang.rollout.default import default_rollout
        from rl_sglang.rollout.generate import GenerateContext

        if self.client is None:  # made on the actor's event loop
            self.client = EngineClient(self.url, api_key=self.api_key)
        groups = [self.held.pop(draw) for draw in resume]
        result = await default_rollout(
            GenerateContext(client=self.client, tokenizer=self.tokenizer),
            iter(templates),
            self.reward.rollout_fn,
            rollout_settings(self.config, len(groups) + len(templates), sampling_params),
            resume=groups,
        )
        for group in [*result.groups, *result.leftovers]:
            relabel(group)
        if self.config.rollout.loop == "async":  # paused, not failed: resumed next chunk
            partial = self.config.rollout.partial_rollout
            for group in (g for g in result.leftovers if not failed(g)):
                self.held[group[0].group_index] = group if partial else restart(group)
        return WorkerOutput(
            kept=[stored(group) for group in result.groups],
            left=[stored(group) for group in result.leftovers],
            metrics=result.metrics,
            reward_counts=self.reward.take_counts(),
            held=sorted(self.held),
        )

    def close(self) -> None:
        self.reward.close()


def stored(group: list[Sample]) -> list[SampleRow]:
    """``group``'s token data put into the object store (owned by this worker), and its
    samples without it."""
    import ray

    for sample in group:
        if sample.status is not SampleStatus.ABORTED:
            sample.validate()
    tokens, log_probs = group_objects(group)
    tokens_ref = ray.put(tokens)
    log_probs_ref = None if log_probs is None else ray.put(log_probs)
    return [sample_row(s, i, tokens_ref, log_probs_ref) for i, s in enumerate(group)]


class WorkerRollout:
    """The rollout function of ``data_plane: workers`` (run by the manager as any rollout
    function): the step's prompts drawn here, dealt to the workers in turn."""

    def __init__(self, workers: list):
        self.workers = workers
        self.holder: dict[int, int] = {}  # draw of a paused group -> the worker holding it
        self.__qualname__ = type(self).__qualname__  # run_rollout names the function by it

    async def __call__(self, ctx) -> list[list[Sample]]:
        templates = list(ctx.prompts(ctx.num_groups))
        num = len(self.workers)
        shares = [templates[w::num] for w in range(num)]
        calls = [
            worker.rollout.remote(share, ctx.sampling_params)
            for worker, share in zip(self.workers, shares, strict=True)
            if share
        ]
        outputs = await asyncio.gather(*calls)
        ctx.metrics.update(merged_metrics(outputs))
        return [group for out in outputs for group in (*out.kept, *out.left)]

    async def generate(self, ctx, num_prompts: int, resume=()):
        """The asynchronous loop's chunk (:meth:`RolloutManager.generate`'s, a RolloutResult):
        ``resume`` (the last chunk's paused groups, as rows: each worker holds its own)
        then ``num_prompts`` new prompts drawn here, dealt so that the workers' loads even
        out; every group launched runs to its end or the next pause."""
        from rl_sglang.rollout.default import RolloutResult

        loads = [[] for _ in self.workers]  # per worker: draws to resume
        for group in resume:
            draw = group[0].group_index
            loads[self.holder.pop(draw)].append(draw)
        shares = [[] for _ in self.workers]
        for template in ctx.prompts(num_prompts):
            lightest = min(range(len(shares)), key=lambda w: len(loads[w]) + len(shares[w]))
            shares[lightest].append(template)
        busy = [w for w in range(len(self.workers)) if shares[w] or loads[w]]
        outputs = await asyncio.gather(
            *(
                self.workers[w].rollout.remote(shares[w], ctx.sampling_params, tuple(loads[w]))
                for w in busy
            )
        )
        for w, out in zip(busy, outputs, strict=True):
            self.holder |= dict.fromkeys(out.held, w)
        groups = sorted((g for out in outputs for g in out.kept), key=lambda g: g[0].group_index)
        left = [g for out in outputs for g in out.left]
        return RolloutResult(groups, left, merged_metrics(outputs))


def merged_metrics(outputs: list[WorkerOutput]) -> dict[str, float]:
    """The workers' rollout metrics as one rollout's: counts summed (the workers' reward
    failures with them), means taken again over every kept sample."""
    merged: dict[str, float] = {}
    for out in outputs:
        for name, value in out.metrics.items():
            if name not in MEANS:
                merged[name] = merged.get(name, 0.0) + value
        for name, count in out.reward_counts.items():
            merged[f"rollout/{name}"] = merged.get(f"rollout/{name}", 0.0) + count
    kept = [s for out in outputs for group in out.kept for s in group]
    lengths = [s.response_length for s in kept] or [0]
    truncated = sum(s.status is SampleStatus.TRUNCATED for s in kept)
    merged["rollout/truncated_frac"] = truncated / max(len(kept), 1)
    merged["rollout/response_length_mean"] = sum(lengths) / len(lengths)
    return merged


def start_rollout_workers(manager) -> list:
    """One :class:`RolloutWorker` per node holding engines (in its first engine's first
    bundle, no resources of its own); one anywhere when engines were started without Ray
    placement. Waits until each is up."""
    import ray

    from rl_launcher.roles.train_group import with_import_path

    pool, actor = manager.engines, ray.remote(RolloutWorker)
    env = with_import_path({})  # rewards by dotted path import there as they do here
    args = (manager.config, manager.tokenizer, pool.url, os.environ.get("RL_SGLANG_API_KEY"))
    options = [{}]
    if pool.sites is not None:
        sites, first_bundle = pool.sites, {}
        for bundles in sites.plan.engine_bundles:
            first_bundle.setdefault(sites.placement.node_ids[bundles[0]], bundles[0])
        options = [
            {"scheduling_strategy": sites.placement.strategy(b)} for b in first_bundle.values()
        ]
    workers = [actor.options(num_cpus=0, runtime_env=env, **o).remote(*args) for o in options]
    ray.get([w.ready.remote() for w in workers])
    return workers


def stop_rollout_workers(workers: list, timeout_s: float = 10.0) -> None:
    """Close each worker's reward (its processes), then end the actors."""
    import ray

    if not workers:
        return
    closing = [worker.close.remote() for worker in workers]
    ray.wait(closing, num_returns=len(closing), timeout=timeout_s)
    for worker in workers:
        ray.kill(worker)


class RowsBuffer(DataBuffer):
    """The data buffer over :class:`SampleRow` samples: groups, filters and advantages as
    :class:`DataBuffer`'s; a step's rank batches are :class:`RankRows`."""

    def pop_step(self, num_groups: int) -> StepBatch:
        if num_groups > len(self._ready):
            raise ValueError(f"asked for {num_groups} groups, {len(self._ready)} are ready")
        groups, self._ready = self._ready[:num_groups], self._ready[num_groups:]
        samples = [s for group in groups for s in group]
        sizes = [len(group) for group in groups]
        whole = rows_of(samples, self.packed_advantages(samples, sizes))
        everything = list(range(len(samples)))
        partitions = (
            [everything]
            if self.num_ranks == 1
            else balanced_partitions([s.num_tokens for s in samples], self.num_ranks)
        )
        return StepBatch(
            samples=samples,
            rank_batches=[whole if p == everything else whole.select(p) for p in partitions],
            partitions=partitions,
            metrics=self._step_metrics(samples),
            group_sizes=sizes,
        )

    def packed_advantages(self, samples: list[SampleRow], group_sizes: list[int]):
        """float32 ``[sum of response lengths]``: :meth:`DataBuffer.advantages`' values,
        each response's in turn, from one tensor (no per-token Python)."""
        import torch

        lengths = torch.tensor([s.response_length for s in samples])
        width = int(lengths.max()) if len(samples) else 0
        within = torch.arange(width)[None, :] < lengths[:, None]  # [B, T]
        mask = within.float()
        for i, sample in enumerate(samples):
            if sample.loss_mask is not None:
                mask[i, : sample.response_length] = torch.tensor(sample.loss_mask).float()
        inputs = AdvantageInputs(
            rewards=torch.tensor([scalar_reward(s, self.reward_key) for s in samples]),
            mask=mask,
            group_size=self.group_size,
            group_sizes=self.ragged(group_sizes),
            gamma=self.gamma,
            lam=self.lam,
            kl=None,
            kl_coef=self.reward_kl_coef,
            whiten=self.whiten,
        )
        per_token, _ = self._estimator(inputs)
        return per_token[within].float().numpy()


def rows_of(samples: list[SampleRow], advantages) -> RankRows:
    """The step's whole batch by reference, with its loss denominators."""
    has_log_probs = all(s.log_probs_ref is not None for s in samples)
    return RankRows(
        tokens_refs=[s.tokens_ref for s in samples],
        log_probs_refs=[s.log_probs_ref for s in samples] if has_log_probs else None,
        rows=[s.row for s in samples],
        lengths=[s.num_tokens for s in samples],
        response_lengths=[s.response_length for s in samples],
        loss_masks=[s.loss_mask for s in samples],
        advantages=advantages,
    ).with_global_denominators()


def rows_buffer(run) -> RowsBuffer | None:
    """The run's buffer when ``rollout.data_plane`` is workers, else None."""
    if run.config.rollout.data_plane != "workers":
        return None
    return RowsBuffer.from_config(run.config, num_ranks=run.num_ranks)
