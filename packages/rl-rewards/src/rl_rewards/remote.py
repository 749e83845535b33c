"""The ``remote`` reward: POST the sample to a reward server and use its JSON reply.

Request body: ``{"response": ..., "label": ...}``. Reply: a JSON number, or an object holding
the score under ``score_key`` (default "score"). Connection errors, HTTP 429 and 5xx are
retried with exponential backoff; other 4xx fail at once. A per-URL semaphore caps how many
requests this process has in flight.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from rl_rewards.registry import register_reward

_SEMAPHORES: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_SEMAPHORES_LOCK = threading.Lock()
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


def _semaphore(url: str, max_concurrency: int) -> threading.BoundedSemaphore:
    with _SEMAPHORES_LOCK:
        return _SEMAPHORES.setdefault(
            (url, max_concurrency), threading.BoundedSemaphore(max_concurrency)
        )


def _post_json(url: str, body: dict[str, Any], token: str | None, timeout_s: float) -> Any:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return json.loads(reply.read())


def _score_of(reply: Any, score_key: str) -> float:
    value = reply.get(score_key) if isinstance(reply, dict) else reply
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"reward server reply has no numeric {score_key!r}: {reply!r}"[:300])
    return float(value)


def _is_retryable(exc: Exception) -> bool:
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code in _RETRY_STATUSES
    return isinstance(exc, urllib.error.URLError | TimeoutError | ConnectionError)


@register_reward(
    "remote", "POST {response, label} to a reward server (token, retries, concurrency cap)"
)
def remote_reward(
    response: str,
    label: object,
    *,
    url: str,
    token: str | None = None,
    timeout_s: float = 30.0,
    retries: int = 3,
    backoff_s: float = 0.5,
    max_concurrency: int = 16,
    score_key: str = "score",
) -> float:
    """The score the server at ``url`` returns for this sample."""
    body = {"response": response, "label": label}
    for attempt in range(retries + 1):
        try:
            with _semaphore(url, max_concurrency):
                return _score_of(_post_json(url, body, token, timeout_s), score_key)
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            if attempt == retries or not _is_retryable(exc):
                raise
        time.sleep(backoff_s * 2**attempt)
    raise AssertionError("unreachable")
