"""Rewards for tests that fail or stall on purpose; light to import (rl-train and reward
worker processes import them by their dotted path, found through PYTHONPATH)."""

import os
import time


def always_fails(response: str, label: str) -> float:
    raise RuntimeError(f"no scorer for label {label!r}")


def fails_on_labels(response: str, label: str) -> float:
    """Exact match, except that the labels listed in $FAIL_ON_LABELS raise and those in
    $SLOW_ON_LABELS take a minute first (comma-separated lists)."""
    if label in _listed("SLOW_ON_LABELS"):
        time.sleep(60)
    if label in _listed("FAIL_ON_LABELS"):
        raise RuntimeError(f"label {label!r} is listed in FAIL_ON_LABELS")
    return float(response.strip() == label)


def _listed(name: str) -> list[str]:
    return [label for label in os.environ.get(name, "").split(",") if label]


def fails_on_low_digits(response: str, label: str) -> float:
    """Exact match, except that the responses 0 to 4 raise: about a third of a random
    model's one-token answers, so groups lose one sample or several, never by label."""
    if response.strip() in ("0", "1", "2", "3", "4"):
        raise RuntimeError(f"response {response!r} is not scored here")
    return float(response.strip() == label)
