"""Engine server processes: the embedded engine and real SGLang, started, watched,
stopped and restarted the same way.

    engine = EmbeddedEngine(model_path="/tmp/tiny", log_dir="logs").start()
    engine.url  # http://127.0.0.1:<free port>
    engine.stop()
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port(host: str = "127.0.0.1", avoid: tuple[int, ...] = ()) -> int:
    """A TCP port nothing listens on right now, none of ``avoid`` (ports handed out for a
    server that has not bound them yet: the system may hand them out again)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
API_KEY_ENV = "RL_SGLANG_API_KEY"  # how the key reaches our servers (not argv: ps shows it)


def check_exposure(host: str, api_key: str | None, what: str = "server") -> None:
    """Loopback needs nothing; any other address needs an API key, because anyone who can
    reach the port could otherwise replace the weights or free the memory."""
    if host not in LOOPBACK_HOSTS and not api_key:
        raise ValueError(
            f"{what} would listen on {host!r}, reachable from other machines, without an "
            f"API key: pass api_key=... (--api-key, or the {API_KEY_ENV} environment "
            "variable) so control endpoints require 'Authorization: Bearer <key>', or keep "
            "host='127.0.0.1'"
        )


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


class ServerProcess:
    """A subprocess serving HTTP on ``host:port``, its output captured in ``log_path``.

    Subclasses give :meth:`command` and :attr:`ready_path`.
    """

    ready_path = "/health"
    name = "server"
    port_retries = 3  # fresh ports after "address already in use", when none was given

    def __init__(
        self,
        *,
        host="127.0.0.1",
        port=None,
        log_dir=None,
        env=None,
        ready_timeout_s=120.0,
        api_key: str | None = None,
    ):
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        check_exposure(host, api_key, self.name)
        self.api_key = api_key
        self.host, self.port = host, port or free_port(host)
        # chosen here and not yet served on: another may be chosen on a clash (once it has
        # answered, clients and the router know the port, and a restart keeps it)
        self.ports_movable = port is None
        self.log_dir = Path(log_dir or os.environ.get("RL_LOG_DIR", "/tmp/rl_sglang_logs"))
        self.env = env or {}
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}-{self.port}.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def module_command(self, module: str, *args: str) -> list[str]:
        """``python -m module --host H --port P *args``, with this interpreter."""
        return [sys.executable, "-m", module, "--host", self.host, "--port", str(self.port), *args]

    def start(self, wait: bool = True) -> "ServerProcess":
        if self.alive():
            raise RuntimeError(f"{self.name} on {self.url} is already running")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env, **self._key_env()},
                start_new_session=True,  # our signals reach its children, not us
            )
        if wait:
            self.wait_ready()
        return self

    def _key_env(self) -> dict[str, str]:
        return {API_KEY_ENV: self.api_key} if self.api_key else {}

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Poll :attr:`ready_path` until it answers 200; on exit or timeout raise with the
        last lines of the log."""
        timeout_s = timeout_s or self.ready_timeout_s
        deadline, retries = time.monotonic() + timeout_s, self.port_retries
        while time.monotonic() < deadline:
            if not self.alive():
                if retries and self._lost_its_port():  # taken between choice and bind
                    retries -= 1
                    self.choose_ports()
                    self.start(wait=False)
                    continue
                raise RuntimeError(
                    f"{self.name} exited with {self.process.poll()}\n{self.log_tail()}"
                )
            if http_ok(self.url + self.ready_path):
                self.ports_movable = False
                return
            time.sleep(0.2)
        raise TimeoutError(
            f"{self.name} on {self.url}: {self.url + self.ready_path} did not answer 200 "
            f"within {timeout_s:g}s\n{self.log_tail()}"
        )

    def _lost_its_port(self) -> bool:
        """Whether the server exited because a port chosen for it was taken meanwhile
        (a free port is only free until someone binds it: Ray starting beside a server
        binds ports of its own)."""
        if not self.ports_movable or not self.log_path.exists():
            return False
        return "address already in use" in self.log_path.read_text(errors="replace").lower()

    def choose_ports(self) -> None:
        """Fresh ports for a start after a clash (subclasses with more ports extend it)."""
        self.port = free_port(self.host, avoid=(self.port,))

    def log_tail(self, num_lines: int = 30) -> str:
        if not self.log_path.exists():
            return "(no log)"
        lines = self.log_path.read_text(errors="replace").splitlines()[-num_lines:]
        return f"last {len(lines)} lines of {self.log_path}:\n" + "\n".join(lines)

    def healthy(self) -> bool:
        return self.alive() and http_ok(self.url + "/health")

    def health(self) -> bool:  # rl_core.protocols.RolloutEngine
        return self.healthy()

    def shutdown(self) -> None:  # rl_core.protocols.RolloutEngine
        self.stop()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``."""
        stop_all([self], grace_s)

    def kill(self) -> None:
        """Die at once, as a crashed engine would."""
        if self.alive():
            self._signal(signal.SIGKILL)
            self.process.wait(10)

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def restart(self, wait: bool = True) -> "ServerProcess":
        """Stop and start again on the same port (the router keeps its URL)."""
        self.stop()
        return self.start(wait=wait)

    def __enter__(self):
        return self.start() if not self.alive() else self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_all(servers: list, grace_s: float = 10.0) -> None:
    """Stop ``servers`` together: SIGTERM to each process group at once, then each waited
    for (SIGKILLed after ``grace_s``), so that their shut-downs overlap: a run's router and
    engines take the longest one's time to stop, not the sum. Servers that are not a
    process of this one (an engine a Ray actor runs on its node) stop themselves first."""
    for server in servers:
        if not isinstance(server, ServerProcess):
            server.stop()
    here = [s for s in servers if isinstance(s, ServerProcess)]
    running = [s for s in here if s.process is not None and s.process.poll() is None]
    for server in running:
        server._signal(signal.SIGTERM)
    for server in running:
        try:
            server.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            server._signal(signal.SIGKILL)
            server.process.wait(grace_s)


class EmbeddedEngine(ServerProcess):
    """``python -m rl_sglang.embedded`` (HF transformers underneath; CPU or one GPU)."""

    name = "embedded"

    def __init__(
        self,
        model_path: str | Path,
        *,
        device="cpu",
        dtype="auto",
        max_batch_size=64,
        weight_version="0",
        extra_args=(),
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.model_path, self.device, self.dtype = str(model_path), device, dtype
        self.max_batch_size, self.weight_version = max_batch_size, weight_version
        self.extra_args = list(extra_args)

    def command(self) -> list[str]:
        return self.module_command(
            "rl_sglang.embedded",
            "--model-path",
            self.model_path,
            "--device",
            self.device,
            "--dtype",
            self.dtype,
            "--max-batch-size",
            str(self.max_batch_size),
            "--weight-version",
            self.weight_version,
            *self.extra_args,
        )


class SGLangServer(ServerProcess):
    """``python -m sglang.launch_server`` with ``sglang_args`` passed through as
    ``--key value`` (see :func:`sglang_args_from_cli` for ``--sglang-*`` options) and
    ``gpu_ids`` as CUDA_VISIBLE_DEVICES. Needs SGLang installed.

    ``sglang_path`` (default: the ``RL_SGLANG_PYTHONPATH`` environment variable) is put in
    front of the server's PYTHONPATH only: SGLang pins its own transformers, which then
    stays out of the trainer's process.
    """

    name = "sglang"

    def __init__(
        self,
        model_path: str | Path,
        *,
        sglang_args=None,
        gpu_ids=None,
        sglang_path: str | None = None,
        **kwargs,
    ):
        sglang_path = sglang_path or os.environ.get("RL_SGLANG_PYTHONPATH")
        require_sglang(sglang_path)
        env = dict(kwargs.pop("env", None) or {})
        if sglang_path:
            inherited = os.environ.get("PYTHONPATH", "")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (sglang_path, inherited) if p)
        if gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids)
        super().__init__(env=env, **kwargs)
        self.model_path, self.sglang_args = str(model_path), dict(sglang_args or {})
        # SGLang derives a gRPC port as --port + 10000 and refuses to start when that is
        # past 65535 (any free port above 55535): give it a free port of its own instead
        self.env.setdefault("SGLANG_GRPC_PORT", str(grpc_port(self.host, self.port)))
        if self.sglang_args.get("enable_memory_saver"):
            # SGLang's /health generates a token; the router's health checks (every few
            # seconds) would then reach a scheduler whose KV cache is released (colocated
            # training) and crash it: /health answers from the HTTP server instead
            self.env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")

    def command(self) -> list[str]:
        argv = self.module_command("sglang.launch_server", "--model-path", self.model_path)
        if self.api_key:  # SGLang reads it from argv only
            argv += ["--api-key", self.api_key]
        for key, value in self.sglang_args.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif isinstance(value, list | tuple):  # nargs="+" options
                argv += [flag, *map(str, value)]
            elif value is not False and value is not None:  # 0 is a value, not "off"
                argv += [flag, str(value)]
        return argv


def grpc_port(host: str, port: int) -> int:
    """A free port for SGLang's gRPC setting other than ``port`` (its HTTP port)."""
    while (candidate := free_port(host)) == port:
        pass
    return candidate


def require_sglang(sglang_path: str | None = None) -> None:
    """Raise ImportError with the install command when SGLang is missing (from this
    interpreter, and from ``sglang_path`` when given)."""
    import importlib.util

    in_path = any((Path(p) / "sglang").is_dir() for p in (sglang_path or "").split(os.pathsep) if p)
    if not in_path and importlib.util.find_spec("sglang") is None:
        raise ImportError(
            "SGLangServer needs SGLang: pip install 'sglang[all]' (GPU machines); "
            "on CPU use EmbeddedEngine instead"
        )


def sglang_args_from_cli(argv: list[str]) -> tuple[dict[str, str | bool], list[str]]:
    """Split ``--sglang-KEY [VALUE]`` options (prefix stripped) from the rest of ``argv``."""
    passthrough, rest, index = {}, [], 0
    while index < len(argv):
        arg = argv[index]
        if not arg.startswith("--sglang-"):
            rest.append(arg)
            index += 1
            continue
        key, _, inline = arg.removeprefix("--sglang-").partition("=")
        has_value = bool(inline) or (index + 1 < len(argv) and not argv[index + 1].startswith("--"))
        value = inline or (argv[index + 1] if has_value and not inline else True)
        passthrough[key.replace("-", "_")] = value
        index += 1 if inline or not has_value else 2
    return passthrough, rest
