"""Generation that never waits for the trainer: the producer of the fully asynchronous loop.

    producer = ContinuousRollout(manager, batch_size=8, max_staleness=2, partial=True)
    manager.engines.call(producer.start())
    groups, metrics = manager.engines.call(producer.take(8, min_version=step - 1 - 2))
    manager.engines.call(producer.stop())

A task on the event loop of the manager's engines calls rl-sglang's default rollout chunk after
chunk (``batch_size`` groups each) and puts every finished group into a queue of at most
``batch_size * max_staleness`` groups (generation pauses while it is full, which keeps the
samples' age bounded). Groups aborted by a weight update (engines paused) come back as
leftovers: with ``partial`` they keep their tokens, log-probs and weight versions and
resume; without it, their aborted samples start again from the prompt. Groups that
*failed* (an engine error after its retries, a reward skipped under
``on_reward_error=skip``: the error is in a sample's metadata) are not tried again but
queued like finished ones, so the trainer's step drops, counts and names them as the
synchronous loop does; retried, a batch whose every sample fails would keep the trainer
waiting for ever without a word. :meth:`take`
hands ``num_groups`` groups to the trainer, dropping (``stale_policy="drop"``) or keeping
and counting (``"importance"``) those generated before ``min_version``.
"""

import asyncio

from rl_core.types import Sample, SampleStatus


def group_version(group: list[Sample], default: int) -> int:
    """The oldest weight version that produced any token of ``group``."""
    versions = [int(v) for s in group for v in s.weight_versions if v.lstrip("-").isdigit()]
    return min(versions, default=default)


def restart(group: list[Sample]) -> list[Sample]:
    """Aborted samples of ``group`` back to their bare prompt (finished ones are kept)."""
    for sample in group:
        if sample.status is SampleStatus.ABORTED:
            sample.tokens = sample.tokens[: sample.prompt_length]
            sample.response, sample.response_length, sample.loss_mask = "", 0, None
            sample.rollout_log_probs, sample.weight_versions = None, []
            sample.routed_experts = None  # the new response's request returns them again
            sample.status = SampleStatus.PENDING
    return group


def failed(group: list[Sample]) -> bool:
    """A sample of ``group`` failed for good: an engine error, a skipped reward failure."""
    return any(s.metadata.get("error") or s.metadata.get("reward_error") for s in group)


class ContinuousRollout:
    """See the module docstring; every coroutine runs on the engines' event loop."""

    def __init__(
        self,
        manager,
        *,
        batch_size: int,
        max_staleness: int,
        partial: bool,
        stale_policy: str = "drop",
    ):
        if max_staleness < 1:
            raise ValueError(
                "rollout.loop=async needs rollout.max_staleness >= 1 (samples generated while "
                "the trainer trains are one version old); use loop=sync for on-policy samples"
            )
        self.manager, self.batch_size, self.partial = manager, batch_size, partial
        self.max_queued, self.stale_policy = batch_size * max_staleness, stale_policy
        self.counts = {"groups_aborted": 0, "chunks": 0}
        self._queue: asyncio.Queue | None = None
        self._room: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._queue, self._room = asyncio.Queue(), asyncio.Event()
        self._task = asyncio.ensure_future(self._produce())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _produce(self) -> None:
        leftovers: list[list[Sample]] = []
        try:
            while True:
                while self._queue.qsize() >= self.max_queued:
                    self._room.clear()
                    await self._room.wait()
                fresh = max(0, self.batch_size - len(leftovers))
                result = await self.manager.generate(self.batch_size, fresh, resume=leftovers)
                self.counts["chunks"] += 1
                self.counts["groups_aborted"] += len(result.leftovers)
                paused = [g for g in result.leftovers if not failed(g)]
                leftovers = paused if self.partial else [restart(g) for g in paused]
                for group in [*result.groups, *(g for g in result.leftovers if failed(g))]:
                    self._queue.put_nowait(group)
        except Exception as error:  # the trainer's next take() raises it
            self._queue.put_nowait(error)

    async def take(self, num_groups: int, *, min_version: int) -> tuple[list, dict[str, float]]:
        """``num_groups`` finished groups, oldest first, and what happened to stale ones."""
        groups, dropped, stale_kept = [], [], 0
        while len(groups) < num_groups:
            group = await self._queue.get()
            self._room.set()
            if isinstance(group, Exception):
                raise RuntimeError(f"asynchronous generation failed: {group}") from group
            if group_version(group, default=min_version) < min_version:
                if self.stale_policy == "drop":
                    dropped.append(group)
                    continue
                stale_kept += 1
            groups.append(group)
        self.manager.consumed(dropped)
        metrics = {
            "async/stale_groups_dropped": float(len(dropped)),
            "async/stale_groups_kept": float(stale_kept),
            "async/queued_groups": float(self._queue.qsize()),
        }
        metrics |= {f"async/{name}": float(value) for name, value in self.counts.items()}
        self.counts = dict.fromkeys(self.counts, 0)
        return sorted(groups, key=lambda g: g[0].group_index), metrics
