"""The remote reward against a real HTTP server on 127.0.0.1 (standard library)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rl_rewards import get_reward
from rl_rewards.batch import score_batch

pytestmark = pytest.mark.integration


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.failures_left = 0
        self.requests = 0


class _Handler(BaseHTTPRequestHandler):
    state: _State

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state = self.server.state
        with state.lock:
            state.requests += 1
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            fail = state.failures_left > 0
            state.failures_left -= fail
        try:
            status, payload = self._answer(body, fail)
        finally:
            # leave the in-flight count before replying: once the client has the reply it
            # may start its next request, which must not overlap this one in the count
            with state.lock:
                state.in_flight -= 1
        self._reply(status, payload)

    def _answer(self, body, fail):
        if self.path == "/auth" and self.headers.get("Authorization") != "Bearer s3cret":
            return 401, {"error": "bad token"}
        if fail:
            return 503, {"error": "busy"}
        time.sleep(0.05)
        score = float(body["response"] == body["label"])
        return 200, score if self.path == "/bare" else {"score": score, "extra": 1}

    def _reply(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.state = _State()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _url(server, path="/score"):
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def test_score_from_json_object_and_bare_number(server):
    assert get_reward("remote", url=_url(server))("yes", "yes") == 1.0
    assert get_reward("remote", url=_url(server))("yes", "no") == 0.0
    assert get_reward("remote", url=_url(server, "/bare"))("a", "a") == 1.0


def test_bearer_token_is_sent_and_4xx_is_not_retried(server):
    assert get_reward("remote", url=_url(server, "/auth"), token="s3cret")("a", "a") == 1.0
    before = server.state.requests
    with pytest.raises(Exception, match="401"):
        get_reward("remote", url=_url(server, "/auth"), token="wrong", retries=3)("a", "a")
    assert server.state.requests == before + 1


def test_retries_with_backoff_after_503(server):
    server.state.failures_left = 2
    start = time.monotonic()
    assert get_reward("remote", url=_url(server), retries=3, backoff_s=0.1)("x", "x") == 1.0
    assert time.monotonic() - start >= 0.1 + 0.2  # two backoffs: 0.1 s then 0.2 s
    server.state.failures_left = 5
    with pytest.raises(Exception, match="503"):
        get_reward("remote", url=_url(server), retries=1, backoff_s=0.01)("x", "x")
    server.state.failures_left = 0


def test_concurrency_cap_holds_under_many_threads(server):
    reward = get_reward("remote", url=_url(server, "/capped"), max_concurrency=2)
    server.state.max_in_flight = 0
    threads = [threading.Thread(target=reward, args=("a", "a")) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert server.state.max_in_flight == 2


def test_unreachable_server_becomes_a_counted_error_in_a_batch(server):
    report = score_batch(
        "remote",
        ["a", "b"],
        ["a", "a"],
        options={"url": _url(server)},
        workers=0,
    )
    assert report.scores == [1.0, 0.0] and report.num_errors == 0
    dead = score_batch(
        "remote", ["a"], ["a"], options={"url": "http://127.0.0.1:9/x", "retries": 0}
    )
    assert dead.num_errors == 1 and "URLError" in dead.results[0].reason
