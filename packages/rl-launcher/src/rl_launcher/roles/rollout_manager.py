"""The rollout manager: engines behind the router, the prompt source and the reward.

    manager = RolloutManager(config, model_dir=..., tokenizer=tok, source=prompts).start()
    groups, metrics = manager.rollout(num_groups=8)   # lists of group_size scored Samples
    future = manager.submit(num_groups=8)               # the same, in the background
    manager.weight_versions()                           # one per engine
    manager.stop()

Generation goes through the real sglang-router (or one engine directly when
``engine.use_router`` is false); aborts, pauses and weight updates go to every engine. One
event loop runs in a background thread as long as the manager lives, so HTTP sessions are
reused between steps and generation can overlap training (:mod:`rl_launcher.loops.feeds`).
Every prompt drawn is remembered until the loop trains on it (or drops it), so a
checkpoint can store the prompts in flight and a resumed run draws them again first.
With embedded engines each prompt's requests are seeded from the run's seed and the
prompt's draw number (:func:`request_seed`), so the same seed, machine and config sample
the same responses whatever requests share a batch (SGLang servers are not asked: see
docs/config.md, ``seed``).
"""

import asyncio
import hashlib
import math
import threading
from concurrent.futures import Future
from pathlib import Path

from rl_core.types import Sample
from rl_launcher.roles.reward import COUNTS, load_run_reward
from rl_launcher.roles.rollout_context import context_of, custom_rollout

ROUTER_NEEDED = "engine.use_router=false works with one engine; set engine.num_engines=1"


class RolloutManager:
    def __init__(self, config, *, model_dir: Path, tokenizer, source, log_dir: Path, reward=None):
        """``reward``: the run's :class:`~rl_launcher.roles.reward.Reward` when one exists
        already (rl-eval's); :meth:`stop` closes it either way."""
        if not config.engine.use_router and config.engine.num_engines > 1:
            raise ValueError(ROUTER_NEEDED)
        self.config, self.model_dir, self.tokenizer = config, Path(model_dir), tokenizer
        self.source, self.log_dir = source, Path(log_dir)
        # with a time limit, reward processes start here
        self.reward_fn = reward or load_run_reward(config, tokenizer)
        self.engines, self.router, self._loop = [], None, asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="rollout-loop", daemon=True
        )
        self._thread.start()
        self._clients: dict = {}  # url -> EngineClient, one keep-alive session each
        self._drawn: dict[int, Sample] = {}  # draw number -> prompt not yet trained on
        self._requeued: list[Sample] = []  # drawn before a resume: handed out first
        self._leftovers: list[list[Sample]] = []  # refill: groups aborted, resumed next step
        self.engine_gpus, self.turns = None, None  # set by session.start (GPU ids, colocation)
        self.sites = (
            None  # engine_hosts.EngineSites under Ray (set by session.start): placed engines
        )
        self.monitor = None  # rl_sglang.health.HealthMonitor, set by roles.engine_health

    def start(self) -> "RolloutManager":
        """Start the engines (embedded or SGLang, :mod:`rl_launcher.roles.engines`; each on
        its own node under Ray) all at once, wait for each, then the router in front of
        them, on this node."""
        from rl_launcher.infra.lifetime import tie_to_this_process
        from rl_launcher.roles.engines import start_engines
        from rl_sglang.router import Router

        engine = self.config.engine
        self.engines = start_engines(
            self.config,
            model_dir=self.model_dir,
            log_dir=self.log_dir,
            gpus=self.engine_gpus,
            max_batch_size=self._batch_limit(),
            memory_saver=self._engines_release(),
            sites=self.sites,
        )
        for server in self.engines:
            server.wait_ready()
        if engine.use_router:
            urls = [e.url for e in self.engines]
            router = Router(urls, host=engine.host, log_dir=self.log_dir)
            self.router = tie_to_this_process(router).start()
        return self

    def _engines_release(self) -> bool:
        """Colocated turns in which the engines give their memory up (SGLang's memory
        saver, which ``/release_memory_occupation`` needs)."""
        return self.turns is not None and self.turns.release_engines

    def _batch_limit(self) -> int:
        samples = self.config.rollout.batch_size * self.config.rollout.group_size
        return max(1, min(256, -(-samples // self.config.engine.num_engines)))

    def client(self, url: str):
        """The manager's client of ``url``: its connections stay open across steps."""
        from rl_sglang.client import EngineClient

        if url not in self._clients:
            self._clients[url] = EngineClient(url)
        return self._clients[url]

    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def engine_nodes(self) -> list[str | None]:
        """Each engine's Ray node; None for engines started here without Ray."""
        if self.sites is None:
            return [None] * len(self.engines)
        return [engine.node_id for engine in self.engines]

    def call(self, coroutine):
        """Run ``coroutine`` on the manager's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def rollout(self, num_groups: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """``num_groups`` prompts, ``group_size`` scored samples each (one prompt drawn per
        group), in draw order."""
        return self.submit(num_groups).result()

    def submit(self, num_groups: int) -> Future:
        """:meth:`rollout` in the background; ``.result()`` waits for it."""
        if self.turns is not None:  # colocated: the devices go to the engines first
            self.turns.generating()
        return asyncio.run_coroutine_threadsafe(self._rollout(num_groups), self._loop)

    async def _rollout(self, num_groups: int):
        if self.config.rollout.rollout_function is not None:  # replaces all of the below
            return await custom_rollout(self, context_of(self, num_groups))
        if refills(self.config):
            return await self._refill(num_groups)
        result = await self.generate(num_groups, num_groups)
        # exactly num_groups prompts: leftovers are only groups an engine error aborted,
        # which the buffer counts and drops
        groups = sorted(result.groups + result.leftovers, key=lambda g: g[0].group_index)
        return groups, result.metrics

    async def _refill(self, num_groups: int):
        """DAPO's refill (``rollout.over_sampling`` with ``algorithm.group_filter``): last
        step's leftovers, then new prompts drawn one launch at a time, up to
        ceil(over_sampling x num_groups) groups in all, until ``num_groups`` pass the
        filter. Groups the filter drops are forgotten (as the buffer's are); groups still
        running are aborted and kept for the next step (their partial responses with
        ``rollout.partial_rollout``, else restarted): their prompts stay pending, so a
        checkpoint keeps them and ``--resume`` draws them first."""
        from rl_launcher.roles.async_rollout import failed, restart

        budget = math.ceil(self.config.rollout.over_sampling * num_groups)
        resume, self._leftovers = self._leftovers, []
        before = set(self._drawn)
        result = await self.generate(
            num_groups, max(0, budget - len(resume)), resume=resume, filtered=True
        )
        kept = [g for g in result.leftovers if not failed(g)]
        self._leftovers = kept if self.config.rollout.partial_rollout else list(map(restart, kept))
        returned = {g[0].group_index for g in [*result.groups, *result.leftovers]}
        drawn = set(self._drawn) - before | {g[0].group_index for g in resume}
        self._forget(sorted(drawn - returned))  # dropped by the filter: never trained on
        groups = result.groups + [g for g in result.leftovers if failed(g)]
        metrics = result.metrics | {
            "rollout/groups_passed": float(len(result.groups)),
            "rollout/groups_aborted": float(len(kept)),
        }
        return sorted(groups, key=lambda g: g[0].group_index), metrics

    async def generate(self, num_groups: int, num_prompts: int, resume=(), filtered=False):
        """rl-sglang's default rollout of ``resume`` (leftover groups) then ``num_prompts``
        new prompts (exactly: none over-drawn, each drawn when its group launches), until
        ``num_groups`` groups are done (``filtered``: passed ``algorithm.group_filter``,
        the others dropped, the rest aborted) or nothing is left; groups are relabelled by
        draw number and sorted by it."""
        from rl_sglang.rollout.default import default_rollout

        settings = self.rollout_settings(num_groups, filtered=filtered)
        ctx = context_of(self, num_groups)  # what a rollout.rollout_function is given
        engines = ctx.engines if filtered else ()
        result = await default_rollout(
            ctx.generate_context(),
            ctx.prompts(num_prompts),
            ctx.reward_fn,
            settings,
            resume=resume,
            engines=engines,
        )
        take_rollout_counts(self.reward_fn, result.metrics)
        for group in [*result.groups, *result.leftovers]:
            relabel(group)
        result.groups.sort(key=lambda group: group[0].group_index)
        return result

    def rollout_settings(self, num_groups: int, filtered: bool = False):
        """rl-sglang's RolloutConfig for ``num_groups`` groups (``filtered``: that pass
        ``algorithm.group_filter``). The run's reward applies
        ``rollout.reward_timeout_s`` and ``rollout.on_reward_error`` itself
        (:mod:`rl_launcher.roles.reward`: a failure it skips is a sample aborted and counted),
        so rl-sglang's guard has no time limit and raises what gets past it."""
        from rl_sglang.rollout.default import RolloutConfig

        rollout, algorithm = self.config.rollout, self.config.algorithm
        return RolloutConfig(
            num_groups=num_groups,
            n_samples_per_prompt=rollout.group_size,
            sampling_params=self.sampling_params(),
            partial_rollout=True,
            max_concurrency=num_groups * rollout.group_size,
            generate_fn=None if rollout.function == "default" else rollout.function,
            reward_timeout_s=None,
            reward_on_error="raise",
            reward_key=algorithm.reward_key,
            group_filter=algorithm.group_filter if filtered else None,
        )

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
        self._loop.call_soon_threadsafe(self._forget, [g[0].group_index for g in groups])

    def _forget(self, draws: list[int]) -> None:
        for draw in draws:
            self._drawn.pop(draw, None)

    def data_state(self) -> dict:
        """The prompt source's position and the prompts drawn but not yet trained on, in
        draw order (JSON); taken on the event loop, so no draw happens half-way."""

        async def snapshot():
            pending = [self._drawn[d].to_dict() for d in sorted(self._drawn)]
            return {"source": self.source.state_dict(), "pending": pending}

        return self.call(snapshot())

    def load_data_state(self, state: dict) -> None:
        """Continue from :meth:`data_state`: its pending prompts are drawn again first."""
        self.source.load_state_dict(state["source"])
        self._requeued = [Sample.from_dict(d) for d in state.get("pending", [])]

    async def pause_generation(self) -> None:
        """Every engine stops; requests in flight come back aborted with what they had."""
        await asyncio.gather(*(self.client(url).pause("abort") for url in self.engine_urls))

    async def continue_generation(self) -> None:
        await asyncio.gather(*(self.client(url).resume() for url in self.engine_urls))

    def sampling_params(self) -> dict:
        rollout = self.config.rollout
        params = {
            "max_new_tokens": rollout.max_response_tokens,
            "temperature": rollout.temperature,
            "top_p": rollout.top_p,
            "top_k": rollout.top_k,
        }
        return params | ({"stop": list(rollout.stop)} if rollout.stop else {})

    def weight_versions(self) -> list[str]:
        return self.call(self._versions())

    async def _versions(self) -> list[str]:
        # /model_info: real SGLang answers 404 on /get_weight_version since 0.5
        infos = (self.client(url).request("GET", "/model_info") for url in self.engine_urls)
        return [str(info["weight_version"]) for info in await asyncio.gather(*infos)]

    def freeze_gc(self) -> list[str]:
        """``gc.freeze()`` in every engine's processes (SGLang's ``/freeze_gc``); what each
        engine answered, or why it could not (an engine without the endpoint keeps its
        collector as it is: this is an optimisation, not a requirement)."""
        return self.call(self._freeze_all())

    async def _freeze_all(self) -> list[str]:
        return await asyncio.gather(*(freeze_gc(self.client(u)) for u in self.engine_urls))

    def release_memory(self, tags: list[str]) -> None:
        """Every engine frees the memory of ``tags`` (weights, kv_cache, cuda_graph)."""
        self.call(self._on_engines("/release_memory_occupation", {"tags": list(tags)}))

    def resume_memory(self, tags: list[str]) -> None:
        self.call(self._on_engines("/resume_memory_occupation", {"tags": list(tags)}))

    async def _on_engines(self, path: str, body: dict) -> None:
        await asyncio.gather(
            *(self.client(u).request("POST", path, body) for u in self.engine_urls)
        )

    def stop(self) -> None:
        if self.monitor is not None:  # first, or it would restart the engines stopped below
            self.monitor.stop()
        self.call(_cancel_in_flight())  # a rollout a stop signal abandoned ends quietly here
        clients, self._clients = list(self._clients.values()), {}
        self.call(_close_all(clients))
        for server in [self.router, *self.engines]:
            if server is not None:
                server.stop()
        self.reward_fn.close()  # its worker processes; calls still waiting fail
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


async def freeze_gc(client) -> str:
    """One engine's answer to ``/freeze_gc``, or why it did not freeze: an engine without
    the endpoint keeps its collector as it is (an optimisation, not a requirement)."""
    try:
        return str(await client.freeze_gc()).strip()
    except Exception as error:  # reported, never fatal
        return f"not frozen: {error}"


async def _cancel_in_flight(timeout_s: float = 10.0) -> None:
    """Cancel every other task on this loop (a rollout still running) and wait for them, so
    none fails later on a closed client or reward pool with an error nobody reads."""
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)


async def _close_all(clients) -> None:
    await asyncio.gather(*(client.close() for client in clients))


def take_rollout_counts(reward, metrics: dict[str, float]) -> None:
    """Move the reward failures rl-sglang's rollout counted (``rollout/reward_errors``,
    ``rollout/reward_timeouts`` in ``metrics``) into the run's ``reward``, whose counts
    reach every step's record in every loop (:func:`rl_launcher.loops.extras.reward_counts`):
    one count per name, neither hiding the other."""
    for name in COUNTS:
        reward.count(name, int(metrics.pop(f"rollout/{name}", 0)))


def refills(config) -> bool:
    """The synchronous rollout refills filtered groups (DAPO): ``rollout.over_sampling`` > 1
    with ``algorithm.group_filter`` set (config/checks.py refuses the loops and sources
    where it cannot)."""
    return config.rollout.over_sampling > 1 and config.algorithm.group_filter != "keep_all"


def request_seed(seed: int, key: int | str) -> int:
    """The ``sampling_seed`` of one prompt's requests: 62 bits of a hash of the run's
    ``seed`` and the prompt's ``key`` (its draw number), so prompts' seeds (and the seed + i
    of their samples) never meet, and runs whose seeds differ by one share none."""
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


def relabel(group: list[Sample]) -> None:
    """rl-sglang numbers groups from 0 in every rollout call; the launcher's groups are
    numbered by draw (unique across calls, so groups of several calls never mix)."""
    draw = group[0].metadata["draw"]
    for i, sample in enumerate(group):
        sample.group_index, sample.index = draw, draw * len(group) + i
