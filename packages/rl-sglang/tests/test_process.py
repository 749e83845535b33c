"""Process wrappers without a model: --sglang-* passthrough, the install hint, log tails."""

import importlib.util
import os
import socket
import sys

import pytest

from rl_sglang.process import (
    EmbeddedEngine,
    ServerProcess,
    SGLangServer,
    free_port,
    sglang_args_from_cli,
)


def test_sglang_args_passthrough_strips_the_prefix():
    argv = [
        "--num-engines",
        "2",
        "--sglang-mem-fraction-static",
        "0.7",
        "--sglang-enable-torch-compile",
        "--sglang-tp=2",
        "--x",
    ]
    passthrough, rest = sglang_args_from_cli(argv)
    assert passthrough == {"mem_fraction_static": "0.7", "enable_torch_compile": True, "tp": "2"}
    assert rest == ["--num-engines", "2", "--x"]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_sglang_server_without_sglang_says_what_to_install():
    with pytest.raises(ImportError, match="pip install"):
        SGLangServer("/models/x", sglang_args={"tp": 2})


def test_sglang_path_goes_to_the_server_only(tmp_path, monkeypatch):
    (tmp_path / "sglang").mkdir()  # looks like a site dir holding SGLang
    monkeypatch.setenv("PYTHONPATH", "/inherited")
    server = SGLangServer("/models/x", sglang_path=str(tmp_path), log_dir=tmp_path)
    assert server.env["PYTHONPATH"] == f"{tmp_path}{os.pathsep}/inherited"
    monkeypatch.setenv("RL_SGLANG_PYTHONPATH", str(tmp_path))
    assert SGLangServer("/models/x", log_dir=tmp_path).env["PYTHONPATH"].startswith(str(tmp_path))
    assert "sglang.launch_server" in server.command()
    assert "--api-key" not in server.command()
    exposed = SGLangServer(
        "/m", sglang_path=str(tmp_path), host="0.0.0.0", api_key="k", log_dir=tmp_path
    )
    assert exposed.command()[-2:] == ["--api-key", "k"]
    with pytest.raises(ValueError, match="API key"):
        SGLangServer("/m", sglang_path=str(tmp_path), host="0.0.0.0", log_dir=tmp_path)


def test_sglang_gets_its_own_grpc_port_even_on_a_high_http_port(tmp_path):
    # SGLang's default gRPC port is --port + 10000: past 65535 it refuses to start
    (tmp_path / "sglang").mkdir()
    server = SGLangServer("/m", sglang_path=str(tmp_path), port=60000, log_dir=tmp_path)
    grpc = int(server.env["SGLANG_GRPC_PORT"])
    assert 1 <= grpc <= 65535 and grpc != 60000
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION" not in server.env


def test_released_memory_is_never_probed_by_a_generating_health_check(tmp_path):
    (tmp_path / "sglang").mkdir()
    server = SGLangServer(
        "/m", sglang_path=str(tmp_path), log_dir=tmp_path, sglang_args={"enable_memory_saver": True}
    )
    assert server.env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"


def test_failed_start_reports_the_log_tail(tmp_path):
    engine = EmbeddedEngine(tmp_path / "missing-model", log_dir=tmp_path, ready_timeout_s=120)
    with pytest.raises(RuntimeError, match=r"last \d+ lines") as info:
        engine.start()
    assert "missing-model" in str(info.value)
    assert not engine.alive()


def test_engines_and_router_are_rollout_engines(tmp_path):
    from rl_core.protocols import RolloutEngine
    from rl_sglang.router import Router

    assert isinstance(EmbeddedEngine(tmp_path, log_dir=tmp_path), RolloutEngine)
    assert isinstance(Router([], log_dir=tmp_path), RolloutEngine)
    with pytest.raises(ValueError, match="policy"):
        Router([], policy="fastest")


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_zero_valued_sglang_options_reach_the_server(tmp_path):
    (tmp_path / "sglang").mkdir()
    args = {"random_seed": 0, "node_rank": 0, "enable_memory_saver": True, "log_requests": False}
    argv = SGLangServer(
        "/m", sglang_path=str(tmp_path), sglang_args=args, log_dir=tmp_path
    ).command()
    assert argv[argv.index("--random-seed") + 1] == "0"
    assert argv[argv.index("--node-rank") + 1] == "0"
    assert "--enable-memory-saver" in argv and "--log-requests" not in argv


class _HttpServer(ServerProcess):
    """Python's own HTTP server: it exits with 'Address already in use' on a taken port."""

    ready_path = "/"
    name = "http"

    def command(self):
        return [sys.executable, "-m", "http.server", str(self.port), "--bind", self.host]


def test_a_server_whose_chosen_port_was_taken_moves_to_another(tmp_path):
    server = _HttpServer(log_dir=tmp_path, ready_timeout_s=60)
    taken = server.port
    with socket.socket() as squatter:  # another process bound it between choice and start
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            server.start()
            assert server.port != taken and server.alive()
            assert "address already in use" in (tmp_path / f"http-{taken}.log").read_text().lower()
        finally:
            server.stop()
    given = _HttpServer(port=taken, log_dir=tmp_path, ready_timeout_s=60)
    with socket.socket() as squatter:  # a port the user gave is not moved
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with pytest.raises(RuntimeError, match="exited with"):
            given.start()
