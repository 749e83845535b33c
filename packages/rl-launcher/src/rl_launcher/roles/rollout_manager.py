"""The rollout manager: the run's engines (an :class:`~rl_launcher.roles.engine_pool.EnginePool`),
the prompt source and the reward.

    manager = RolloutManager(config, model_dir=..., tokenizer=tok, source=prompts).start()
    groups, metrics = manager.rollout(num_groups=8, step=1)  # group_size scored Samples each
    future = manager.submit(num_groups=8, step=2)           # the same, in the background
    manager.engines.weight_versions()                   # one per engine
    manager.stop()

A step's rollout is a rollout function run on a
:class:`~rl_launcher.roles.rollout_context.RolloutContext`: ``rollout.rollout_function``,
or the built-in :func:`~rl_launcher.roles.default_rollout.default_rollout` when it is
unset, both through :func:`~rl_launcher.roles.rollout_context.run_rollout`.
Generation goes through the real sglang-router (or one engine directly when
``engine.use_router`` is false), on the pool's event loop; aborts, pauses and weight
updates go to every engine through the pool.
Every prompt drawn is remembered until the loop trains on it (or drops it), so a
checkpoint can store the prompts in flight and a resumed run draws them again first.
With embedded engines each prompt's requests are seeded from the run's seed and the
prompt's draw number (:func:`request_seed`), so the same seed, machine and config sample
the same responses whatever requests share a batch (SGLang servers are not asked: see
docs/config.md, ``seed``).
"""

import asyncio
import hashlib
from concurrent.futures import Future
from pathlib import Path

from rl_core.types import Sample
from rl_launcher.config.extensions import load_hook
from rl_launcher.roles.default_rollout import default_rollout, generate_groups
from rl_launcher.roles.engine_pool import EnginePool
from rl_launcher.roles.reward import COUNTS, load_run_reward
from rl_launcher.roles.rollout_context import context_of, run_rollout
from rl_launcher.roles.rollout_workers import (
    WorkerRollout,
    start_rollout_workers,
    stop_rollout_workers,
)


class RolloutManager:
    def __init__(self, config, *, model_dir: Path, tokenizer, source, log_dir: Path, reward=None):
        """``reward``: the run's :class:`~rl_launcher.roles.reward.Reward` when one exists
        already (rl-eval's); :meth:`stop` closes it either way."""
        self.engines = EnginePool(config, model_dir=model_dir, log_dir=log_dir)
        self.config, self.model_dir, self.tokenizer = config, Path(model_dir), tokenizer
        self.source, self.log_dir = source, Path(log_dir)
        # with a time limit, reward processes start here
        self.reward_fn = reward or load_run_reward(config, tokenizer)
        self._drawn: dict[int, Sample] = {}  # draw number -> prompt not yet trained on
        self._requeued: list[Sample] = []  # drawn before a resume: handed out first
        self._leftovers: list[list[Sample]] = []  # a rollout's ctx.leftovers, for the next
        self._rollouts_started = 0  # a RolloutContext's rollout_id
        self.rollout_function = (
            default_rollout
            if config.rollout.rollout_function is None
            else load_hook(config, "rollout.rollout_function")
        )
        self.workers: list = []  # rollout.data_plane=workers: one per node with engines

    def start(self) -> "RolloutManager":
        """Start the engines and the router (:meth:`EnginePool.start`)."""
        self.engines.start(max_batch_size=engine_batch_limit(self.config))
        if self.config.rollout.data_plane == "workers":  # samples stay on the workers
            self.workers = start_rollout_workers(self)
            self.rollout_function = WorkerRollout(self.workers)
        return self

    def rollout(
        self, num_groups: int, step: int | None = None
    ) -> tuple[list[list[Sample]], dict[str, float]]:
        """``num_groups`` prompts, ``group_size`` scored samples each (one prompt drawn per
        group), in draw order, for rl-train step ``step`` (None: the step after the weights
        the engines hold)."""
        return self.submit(num_groups, step).result()

    def submit(self, num_groups: int, step: int | None = None) -> Future:
        """:meth:`rollout` in the background; ``.result()`` waits for it."""
        if self.engines.turns is not None:  # colocated: the devices go to the engines first
            self.engines.turns.generating()
        step = self.engines.weight_version + 1 if step is None else step
        return asyncio.run_coroutine_threadsafe(self._rollout(num_groups, step), self.engines.loop)

    async def _rollout(self, num_groups: int, step: int):
        """The rollout function (the configured one or the built-in) on a fresh context."""
        ctx = context_of(self, num_groups, step)
        ctx.leftovers, self._leftovers = self._leftovers, []
        groups = await run_rollout(self.rollout_function, ctx, self._drawn)
        self._leftovers = ctx.leftovers
        take_rollout_counts(self.reward_fn, ctx.metrics)
        return groups, ctx.metrics

    async def generate(self, num_groups: int, num_prompts: int, resume=()):
        """The built-in's :func:`~rl_launcher.roles.default_rollout.generate_groups` of
        ``resume`` then ``num_prompts`` new prompts until ``num_groups`` are done (the
        asynchronous loop's chunks: their step is the first that may take them)."""
        ctx = context_of(self, num_groups, self.engines.weight_version + 1)
        if self.workers:  # rollout.data_plane=workers: the workers generate, and hold leftovers
            result = await self.rollout_function.generate(ctx, num_prompts, resume=resume)
        else:
            result = await generate_groups(ctx, num_prompts, resume=resume)
        take_rollout_counts(self.reward_fn, result.metrics)
        return result

    def next_prompt(self) -> Sample:
        """The next prompt (requeued ones first), remembered until :meth:`consumed`."""
        template = self._requeued.pop(0) if self._requeued else self.source.next_prompt()
        template.metadata["draw"] = template.group_index  # the source numbers its draws
        if self.config.engine.kind == "embedded":  # sample i of the group: this + i
            template.metadata["sampling_seed"] = request_seed(
                self.config.seed, template.group_index
            )
        self._drawn[template.group_index] = template
        return template

    def consumed(self, groups: list[list[Sample]]) -> None:
        """The loop is done with these groups' prompts (trained on or dropped)."""
        self.engines.loop.call_soon_threadsafe(self._forget, [g[0].group_index for g in groups])

    def _forget(self, draws: list[int]) -> None:
        for draw in draws:
            self._drawn.pop(draw, None)

    def data_state(self) -> dict:
        """The prompt source's position and the prompts drawn but not yet trained on, in
        draw order (JSON); taken on the event loop, so no draw happens half-way."""

        async def snapshot():
            pending = [self._drawn[d].to_dict() for d in sorted(self._drawn)]
            return {"source": self.source.state_dict(), "pending": pending}

        return self.engines.call(snapshot())

    def load_data_state(self, state: dict) -> None:
        """Continue from :meth:`data_state`: its pending prompts are drawn again first."""
        self.source.load_state_dict(state["source"])
        self._requeued = [Sample.from_dict(d) for d in state.get("pending", [])]

    def sampling_params(self) -> dict:
        rollout = self.config.rollout
        params = {
            "max_new_tokens": rollout.max_response_tokens,
            "temperature": rollout.temperature,
            "top_p": rollout.top_p,
            "top_k": rollout.top_k,
        }
        return params | ({"stop": list(rollout.stop)} if rollout.stop else {})

    def stop(self) -> None:
        self.engines.stop()  # first: a rollout still running is cancelled
        stop_rollout_workers(self.workers)
        self.reward_fn.close()  # its worker processes


def take_rollout_counts(reward, metrics: dict[str, float]) -> None:
    """Move the reward failures rl-sglang's rollout counted (``rollout/reward_errors``,
    ``rollout/reward_timeouts`` in ``metrics``) into the run's ``reward``, whose counts
    reach every step's record in every loop (:func:`rl_launcher.loops.extras.reward_counts`):
    one count per name, neither hiding the other."""
    for name in COUNTS:
        reward.count(name, int(metrics.pop(f"rollout/{name}", 0)))


def request_seed(seed: int, key: int | str) -> int:
    """The ``sampling_seed`` of one prompt's requests: 62 bits of a hash of the run's
    ``seed`` and the prompt's ``key`` (its draw number), so prompts' seeds (and the seed + i
    of their samples) never meet, and runs whose seeds differ by one share none."""
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


def engine_batch_limit(config) -> int:
    """Requests an embedded engine batches at once: the step's samples per engine, at most
    1,024 on GPUs (fewer slots admit the rollout in dozens of small prefills; the engine
    lowers it to the slots that fit in ``engine.mem_fraction``) and 256 on CPUs."""
    samples = config.rollout.batch_size * config.rollout.group_size
    cap = 1024 if config.cluster.device == "cuda" else 256
    return max(1, min(cap, -(-samples // config.engine.num_engines)))
