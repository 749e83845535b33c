"""rl-train's last act (issue 21): :func:`rl_launcher.infra.lifetime.exit_now` ends the
process with its status without the interpreter's teardown, after what a normal exit does
first: threads that are not daemons finish, thread pools wind down, atexit handlers run,
and buffered output reaches a pipe."""

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from rl_launcher.infra.lifetime import exit_now

    class Teardown:  # freed by the interpreter's teardown only (a module global)
        def __del__(self):
            print("torn down", flush=True)

    kept = Teardown()
    pool = ThreadPoolExecutor(1)  # idle worker threads: a plain join would wait for ever
    pool.submit(time.sleep, 0.01).result()
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
    atexit.register(lambda: print("atexit ran"))
    print("buffered, not flushed")  # stdout is a pipe: block-buffered
    exit_now(3)
    """
)


def test_exit_now_keeps_the_normal_exits_first_steps_and_its_status():
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 3, done.stderr
    lines = done.stdout.splitlines()
    assert lines == ["buffered, not flushed", "thread done", "atexit ran"], done.stdout
