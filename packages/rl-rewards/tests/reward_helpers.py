"""Module-level rewards for tests (importable by worker processes through a dotted path)."""

import time


def hang(response: str, label: object) -> float:
    """Never returns when the response says "hang" (a busy loop no thread could interrupt)."""
    while response == "hang":
        pass
    return 1.0


def boom(response: str, label: object) -> float:
    if response == "boom":
        raise RuntimeError("reward exploded")
    return 0.5


def sleepy(response: str, label: object) -> float:
    time.sleep(float(response))
    return 1.0


def not_a_number(response: str, label: object) -> float:
    return float("nan") if response == "nan" else "high"  # type: ignore[return-value]


def length_reward(response: str, label: object, *, scale: float = 1.0) -> float:
    return scale * len(response)


NOT_CALLABLE = 3


def die(response: str, label: object) -> float:
    """Kills its own process (as a segfaulting extension would) when told to."""
    if response == "die":
        import os

        os._exit(3)
    return 1.0


def faulty(response: str, label: object) -> float:
    """1.0, unless the response names a fault: boom (raises), nan, inf, hang (busy loop
    no signal-free thread could stop), sleep (blocks in a system call)."""
    if response == "boom":
        raise RuntimeError("reward exploded")
    if response in ("nan", "inf"):
        return float(response)
    if response == "sleep":
        time.sleep(60)
    return hang(response, label)
