"""A reward for tests that runs in reward worker processes: light to import (each process
that replaces a killed one imports it again), importable through the tests' sys.path."""

import time


def stuck_reward(response: str, label: str) -> float:
    """Exact match, except that label "spin" never returns (a busy loop holding the GIL,
    as a catastrophic regex would) and "sleep" blocks in a system call for a minute."""
    if label == "spin":
        while True:
            pass
    if label == "sleep":
        time.sleep(60)
    return float(response.strip() == label)
