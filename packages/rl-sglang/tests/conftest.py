"""Shared fixtures: one tiny model directory, a reference copy of the model, and one
cluster (two embedded engines behind the real sglang-router) per test session."""

import asyncio

import pytest
import torch

from rl_sglang.process import EmbeddedEngine
from rl_sglang.router import Router
from rl_sglang.tiny import byte_tokenizer, save_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


def teacher_forced_logprobs(model, prompt, output_ids, temperature=1.0) -> list[float]:
    """Log-probs of ``output_ids`` after ``prompt`` from one unbatched forward."""
    ids = torch.tensor([list(prompt) + list(output_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt) - 1
    return [logprobs[start + i, tok].item() for i, tok in enumerate(output_ids)]


class Cluster:
    def __init__(self, engines, router):
        self.engines, self.router = engines, router

    @property
    def engine_urls(self):
        return [e.url for e in self.engines]


@pytest.fixture(scope="session")
def cluster(tiny_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("logs")
    engines = [EmbeddedEngine(tiny_dir, log_dir=log_dir, max_batch_size=16) for _ in range(2)]
    try:
        for engine in engines:
            engine.start(wait=False)
        for engine in engines:
            engine.wait_ready(timeout_s=240)
        router = Router([e.url for e in engines], log_dir=log_dir, ready_timeout_s=120).start()
        yield Cluster(engines, router)
        router.stop()
    finally:
        for engine in engines:
            engine.stop()


def generate(engine, **body):
    """An in-process engine's outputs for one request body (every group it makes)."""

    async def go():
        groups, _ = engine.make_requests(body)
        outs = await asyncio.gather(*(engine.run(g) for g in groups))
        return [o for out in outs for o in out]

    return asyncio.run(go())


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def fault_cluster(tiny_dir, tmp_path_factory):
    """Two more engines behind a router whose own retries are off, so that the faults the
    tests inject reach our health monitor and rollout retries (not the router's)."""
    log_dir = tmp_path_factory.mktemp("fault-logs")
    engines = [EmbeddedEngine(tiny_dir, log_dir=log_dir, max_batch_size=64) for _ in range(2)]
    try:
        for engine in engines:
            engine.start(wait=False)
        for engine in engines:
            engine.wait_ready(timeout_s=240)
        router = Router(
            [e.url for e in engines],
            log_dir=log_dir,
            ready_timeout_s=120,
            health_check_interval_s=1,
            extra_args=["--disable-retries"],
        ).start()
        yield Cluster(engines, router)
        router.stop()
    finally:
        for engine in engines:
            engine.stop()
