"""Servers bind loopback unless told otherwise; exposing one needs an API key, which then
guards every control endpoint (and generation) of the engine and the router's admin API;
weight buckets are unpickled through an exact allowlist."""

import asyncio
import base64
import pickle
import socket

import pytest
import torch

from conftest import run
from rl_sglang.client import EngineClient, EngineError
from rl_sglang.embedded import parse_args
from rl_sglang.engine.weights import deserialize_bucket
from rl_sglang.process import EmbeddedEngine
from rl_sglang.router import Router
from rl_sglang.transports import serialize_bucket

KEY = "s3cret-token"
CONTROL = [  # every endpoint that replaces weights, frees memory or stops work
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent"}),
    ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["AA=="]}),
    ("POST", "/init_weights_update_group", {"master_address": "127.0.0.1"}),
    ("POST", "/update_weights_from_distributed", {"names": []}),
    ("POST", "/release_memory_occupation", {}),
    ("POST", "/resume_memory_occupation", {}),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/flush_cache", None),
    ("POST", "/freeze_gc", None),
]


def listening_address(port: int) -> str:
    """The local address a LISTEN socket on ``port`` is bound to, from /proc/net/tcp."""
    with open("/proc/net/tcp") as table:
        lines = table.read().splitlines()[1:]
    for line in lines:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            return socket.inet_ntoa(bytes.fromhex(address)[::-1])
    raise AssertionError(f"nothing listens on port {port}")


@pytest.mark.integration
def test_engines_router_and_metrics_listen_on_loopback_only(cluster):
    ports = [e.port for e in cluster.engines]
    ports += [cluster.router.port, cluster.router.prometheus_port]
    assert {listening_address(port) for port in ports} == {"127.0.0.1"}


def test_exposing_a_server_without_a_key_is_refused(tmp_path):
    for make in (lambda **kw: EmbeddedEngine(tmp_path, **kw), lambda **kw: Router([], **kw)):
        with pytest.raises(ValueError, match="api_key"):
            make(host="0.0.0.0", log_dir=tmp_path)
        assert make(host="0.0.0.0", api_key=KEY, log_dir=tmp_path).host == "0.0.0.0"
    assert parse_args(["--model-path", "m"]).host == "127.0.0.1"
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--host", "0.0.0.0"])
    assert parse_args(["--model-path", "m", "--host", "0.0.0.0", "--api-key", KEY]).api_key == KEY


def test_the_key_can_come_from_the_environment_for_servers_and_clients(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_SGLANG_API_KEY", KEY)
    engine = EmbeddedEngine(tmp_path, host="0.0.0.0", log_dir=tmp_path)
    assert engine.api_key == KEY and engine._key_env() == {"RL_SGLANG_API_KEY": KEY}
    assert EngineClient("http://127.0.0.1:1").headers == {"Authorization": f"Bearer {KEY}"}
    assert parse_args(["--model-path", "m", "--host", "0.0.0.0"]).api_key == KEY


@pytest.fixture(scope="module")
def exposed(tiny_dir, tmp_path_factory):
    """An engine and a router listening on every interface, both with the key."""
    log_dir = tmp_path_factory.mktemp("exposed")
    engine = EmbeddedEngine(tiny_dir, host="0.0.0.0", api_key=KEY, log_dir=log_dir)
    with engine:
        engine_url = f"http://127.0.0.1:{engine.port}"
        router = Router(
            [engine_url], host="0.0.0.0", api_key=KEY, log_dir=log_dir, ready_timeout_s=120
        )
        with router:
            yield engine_url, f"http://127.0.0.1:{router.port}", router


async def _status(url, method, path, body, key=None) -> int:
    async with EngineClient(url, api_key=key) as client:
        try:
            await client.request(method, path, body)
        except EngineError as error:
            return error.status
        return 200


@pytest.mark.integration
def test_exposed_engine_requires_the_key_on_control_endpoints(exposed):
    engine_url = exposed[0]

    async def go():
        version = await EngineClient(engine_url, api_key=KEY).weight_version()
        for method, path, body in CONTROL:
            assert await _status(engine_url, method, path, body) == 401, path
            assert await _status(engine_url, method, path, body, key="wrong") == 401, path
        assert await _status(engine_url, "GET", "/health", None) == 200  # probes stay open
        generate = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}
        assert await _status(engine_url, "POST", "/generate", generate) == 401
        assert await _status(engine_url, "POST", "/generate", generate, key=KEY) == 200
        # with the key the request reaches the handler: a bad path is a 400, not a 401
        disk = CONTROL[0]
        assert await _status(engine_url, *disk, key=KEY) == 400
        assert await EngineClient(engine_url, api_key=KEY).weight_version() == version

    run(go())


@pytest.mark.integration
def test_exposed_router_requires_the_key_and_forwards_it(exposed):
    _, router_url, router = exposed
    generate = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}

    async def go():
        assert await _status(router_url, "POST", "/generate", generate) == 401
        assert await _status(router_url, "GET", "/workers", None) == 401
        assert await _status(router_url, "POST", "/workers", {"url": "http://evil:1"}) == 401
        assert await _status(router_url, "POST", "/generate", generate, key=KEY) == 200

    run(go())
    assert router.worker_urls(healthy_only=True)  # our own admin calls carry the key


def _payload(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


class _Call:
    """Pickles as a call of ``fn(*args)``: what an attacker's bucket would contain."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize(
    "fn",
    [
        torch.load,
        torch.storage._load_from_bytes,
        torch.hub.load,
        torch.utils.cpp_extension.load_inline if hasattr(torch.utils, "cpp_extension") else eval,
        getattr,
        eval,
        asyncio.run,
    ],
)
def test_bucket_unpickler_refuses_code_running_globals(fn):
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        deserialize_bucket(_payload(_Call(fn, "x")))


@pytest.mark.parametrize("flatten", [False, True])
def test_bucket_unpickler_still_loads_real_buckets(flatten):
    named = [("a", torch.randn(3, 2)), ("b", torch.ones(4, dtype=torch.bfloat16))]
    payload, _keep_alive = serialize_bucket(named, flatten=flatten)  # owns the shared memory
    bucket = deserialize_bucket(payload)
    if flatten:
        assert [r["name"] for r in bucket["metadata"]] == ["a", "b"]  # records decode as dicts
    else:
        assert [n for n, _ in bucket] == ["a", "b"] and torch.equal(bucket[0][1], named[0][1])
