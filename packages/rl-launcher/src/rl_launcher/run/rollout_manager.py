"""The rollout manager: engines behind the router, the prompt source and the reward.

    manager = RolloutManager(config, model_dir=..., tokenizer=tok, source=prompts).start()
    groups, metrics = manager.rollout(num_groups=8)   # lists of group_size scored Samples
    manager.weight_versions()                           # one per engine
    manager.stop()

Generation goes through the real sglang-router (or one engine directly when
``engine.use_router`` is false); aborts and weight updates go to every engine. One event
loop lives as long as the manager, so HTTP sessions are reused between steps.
"""

import asyncio
from pathlib import Path

from rl_core.types import Sample
from rl_launcher.run.reward import load_reward

ROUTER_NEEDED = "engine.use_router=false works with one engine; set engine.num_engines=1"


class RolloutManager:
    def __init__(self, config, *, model_dir: Path, tokenizer, source, log_dir: Path):
        self.config, self.model_dir, self.tokenizer = config, Path(model_dir), tokenizer
        self.source, self.log_dir = source, Path(log_dir)
        self.reward_fn = load_reward(config.rollout.reward, tokenizer)
        self.engines, self.router, self._loop = [], None, asyncio.new_event_loop()
        self._clients: dict = {}  # url -> EngineClient, one keep-alive session each
        if not config.engine.use_router and config.engine.num_engines > 1:
            raise ValueError(ROUTER_NEEDED)

    def start(self) -> "RolloutManager":
        from rl_sglang.process import EmbeddedEngine
        from rl_sglang.router import Router

        if self.config.engine.kind != "embedded":
            raise ValueError("engine.kind=sglang is not wired into rl-train yet; use embedded")
        engine = self.config.engine
        device = "cuda" if self.config.cluster.device == "cuda" else "cpu"
        self.engines = [
            EmbeddedEngine(self.model_dir, device=device, host=engine.host, log_dir=self.log_dir,
                           max_batch_size=self._batch_limit()).start(wait=False)
            for _ in range(engine.num_engines)
        ]  # fmt: skip
        for server in self.engines:
            server.wait_ready()
        if engine.use_router:
            urls = [e.url for e in self.engines]
            self.router = Router(urls, host=engine.host, log_dir=self.log_dir).start()
        return self

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

    def rollout(self, num_groups: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """``num_groups`` prompts, ``group_size`` scored samples each (one prompt drawn per group)."""
        return self._loop.run_until_complete(self._rollout(num_groups))

    async def _rollout(self, num_groups: int):
        from rl_sglang.rollout.default import RolloutConfig, default_rollout
        from rl_sglang.rollout.generate import GenerateContext

        rollout = self.config.rollout
        url = self.router.url if self.router else self.engines[0].url
        settings = RolloutConfig(
            num_groups=num_groups, n_samples_per_prompt=rollout.group_size,
            sampling_params=self.sampling_params(),
            max_concurrency=num_groups * rollout.group_size,
            generate_fn=None if rollout.function == "default" else rollout.function,
        )  # fmt: skip
        # exactly num_groups prompts: no over-drawn prompt is lost from the data order
        prompts = (self.source.next_prompt() for _ in range(num_groups))
        ctx = GenerateContext(client=self.client(url), tokenizer=self.tokenizer)
        result = await default_rollout(ctx, prompts, self.reward_fn, settings)
        return result.groups, result.metrics

    def sampling_params(self) -> dict:
        rollout = self.config.rollout
        params = {"max_new_tokens": rollout.max_response_tokens, "temperature": rollout.temperature,
                  "top_p": rollout.top_p, "top_k": rollout.top_k}  # fmt: skip
        return params | ({"stop": list(rollout.stop)} if rollout.stop else {})

    def weight_versions(self) -> list[str]:
        return self._loop.run_until_complete(self._versions())

    async def _versions(self) -> list[str]:
        versions = (self.client(url).weight_version() for url in self.engine_urls)
        return list(await asyncio.gather(*versions))

    def stop(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        self._loop.run_until_complete(_close_all(clients))
        for server in [self.router, *self.engines]:
            if server is not None:
                server.stop()
        self._loop.close()


async def _close_all(clients) -> None:
    await asyncio.gather(*(client.close() for client in clients))
