"""sglang-router (PyPI ``sglang-router``, a Rust binary) in front of N engines.

    router = Router([e.url for e in engines], policy="round_robin").start()
    EngineClient(router.url).generate(...)   # /generate is balanced over the workers
    router.add_worker(url); router.remove_worker(url)

The router forwards /generate, /flush_cache and the info endpoints; control calls
(abort, pause, weight updates) go to each engine: :meth:`Router.worker_urls` lists them.
It binds 127.0.0.1 (the binary's own default is 0.0.0.0); another ``host`` needs
``api_key``, which then guards /generate, the /workers admin API and the calls to workers.
"""

import json
import time
import urllib.request

from rl_sglang.process import ServerProcess, free_port

POLICIES = ("round_robin", "cache_aware", "random", "power_of_two")


class Router(ServerProcess):
    """The real router as a subprocess; its Prometheus metrics on ``prometheus_port``
    (loopback)."""

    name = "router"
    ready_path = "/health"

    def __init__(
        self,
        worker_urls,
        *,
        policy="round_robin",
        prometheus_port=None,
        health_check_interval_s=2,
        extra_args=(),
        **kwargs,
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; choose one of {POLICIES}")
        super().__init__(**kwargs)
        self.initial_workers, self.policy = list(worker_urls), policy
        self.prometheus_port = prometheus_port or free_port(self.host, avoid=(self.port,))
        self.ports_movable = self.ports_movable and prometheus_port is None
        self.health_check_interval_s = health_check_interval_s
        self.extra_args = list(extra_args)

    def choose_ports(self) -> None:
        super().choose_ports()
        self.prometheus_port = free_port(self.host, avoid=(self.port, self.prometheus_port))

    def command(self) -> list[str]:
        return self.module_command(
            "sglang_router.launch_router",
            "--worker-urls",
            *self.initial_workers,
            "--policy",
            self.policy,
            "--prometheus-host",
            self.host,
            "--prometheus-port",
            str(self.prometheus_port),
            "--health-check-interval-secs",
            str(self.health_check_interval_s),
            "--health-failure-threshold",
            "1",
            "--log-level",
            "warn",
            *self._auth_args(),
            *self.extra_args,
        )

    def _auth_args(self) -> list[str]:
        """One key for everything: clients' /generate, the router's calls to its workers
        (``--api-key``) and the worker admin API (an admin control-plane key)."""
        if not self.api_key:
            return []
        return [
            "--api-key",
            self.api_key,
            "--control-plane-api-keys",
            f"rl:rl-sglang:admin:{self.api_key}",
        ]

    def wait_ready(self, timeout_s: float | None = None) -> None:
        super().wait_ready(timeout_s)
        self.wait_for_workers(self.initial_workers, timeout_s=timeout_s or self.ready_timeout_s)

    # ---- the /workers API ---------------------------------------------------------------
    def workers(self) -> list[dict]:
        """The router's view: one dict per worker (``url``, ``id``, ``is_healthy``, ...)."""
        return self._call("GET", "/workers")["workers"]

    def worker_urls(self, healthy_only: bool = False) -> list[str]:
        return [w["url"] for w in self.workers() if w.get("is_healthy") or not healthy_only]

    def add_worker(self, url: str, timeout_s: float = 60.0) -> None:
        """Register a running engine and wait until the router routes to it."""
        body = {"url": url} | ({"api_key": self.api_key} if self.api_key else {})
        self._call("POST", "/workers", body)
        self.wait_for_workers([url], timeout_s=timeout_s)

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """Deregister a worker (by URL) and wait until it is gone."""
        ids = [w["id"] for w in self.workers() if w["url"] == url]
        if not ids:
            raise ValueError(f"{url} is not a worker of {self.url}; workers: {self.worker_urls()}")
        self._call("DELETE", f"/workers/{ids[0]}")
        self._wait(lambda: url not in self.worker_urls(), f"{url} removed", timeout_s)

    def wait_for_workers(self, urls, timeout_s: float = 60.0) -> None:
        wanted = set(urls)
        self._wait(
            lambda: wanted <= set(self.worker_urls(healthy_only=True)),
            f"workers {sorted(wanted)} healthy",
            timeout_s,
        )

    def metrics(self) -> str:
        """The Prometheus text exposition."""
        url = f"http://{self.host}:{self.prometheus_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()

    def _wait(self, condition, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"router {self.url}: {what} not reached in {timeout_s}s\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read().decode()
        return json.loads(text) if text else {}
