"""Another thread of the process running Python bytecode for the length of a block: what a
reward or engine call shares the GIL with in the driver while a rollout overlaps training."""

import contextlib
import threading


@contextlib.contextmanager
def busy_thread(busy: bool = True):
    """With ``busy``, a daemon thread spins in Python until the block ends."""
    stop = threading.Event()

    def spin():
        count = 0
        while not stop.is_set():
            count += 1

    if busy:
        threading.Thread(target=spin, daemon=True).start()
    try:
        yield
    finally:
        stop.set()
