"""Servers that die with the run.

rl-sglang starts engines and the router in sessions of their own (so that a Ctrl-C meant
for them does not reach the trainer), and stops them itself. An rl-train killed with
SIGKILL (``kill -9``, the OOM killer, a preempted job) never gets to: they would live on,
holding ports and memory. :func:`tie_to_this_process` prefixes a server's command with a
tiny launcher that asks Linux to SIGKILL it when this process dies (``PR_SET_PDEATHSIG``,
kept across ``exec``), then becomes the server. Elsewhere the command is left unchanged.

    server = tie_to_this_process(EmbeddedEngine(model_dir)).start()

:func:`exit_now` ends the process once the run has closed, without the interpreter's
teardown.
"""

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

# argv: PARENT_PID COMMAND...; exits at once if the parent is already gone
_LAUNCHER = """\
import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
if os.getppid() != int(sys.argv[1]):
    sys.exit("rl-launcher: the run died before its server started")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def tied_command(command: list[str], parent_pid: int) -> list[str]:
    """``command`` run so that it is SIGKILLed when ``parent_pid`` (its parent) dies."""
    return [sys.executable, "-c", _LAUNCHER, str(parent_pid), *command]


def tie_to_this_process(server):
    """``server`` (an rl-sglang ServerProcess, not started) dies with this process.

    The kernel signals when the *thread* that started the child exits, so start the server
    from a thread that lives as long as the run (the main thread)."""
    if not sys.platform.startswith("linux"):
        return server
    command, parent = server.command, os.getpid()
    server.command = lambda: tied_command(command(), parent)
    return server


def exit_now(code: int) -> NoReturn:
    """End the process with status ``code``: what a normal exit does first (join the
    threads that are not daemons, run the atexit handlers, flush stdout and stderr), then
    ``os._exit``, skipping the interpreter's teardown that follows: freeing the modules and
    objects of torch, transformers and Ray one by one, 1.5-2.5 s of CPU on a 2-core
    machine once the run has closed (engines, router, ranks and Ray stopped), with nothing
    left to write."""
    threading._shutdown()  # as at exit: thread pools' exit hooks, then joins the threads
    atexit._run_exitfuncs()  # logging's flush, Ray's own shutdown (a no-op by now), ...
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or its reader gone
            stream.flush()
    os._exit(code)
