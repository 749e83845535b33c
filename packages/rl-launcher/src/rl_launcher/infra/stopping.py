"""Orderly stops: SIGTERM (what Slurm and Kubernetes send) and SIGINT (Ctrl-C) take one path.

- While the run starts (model, Ray, trainer, engines), a signal stops it at once: nothing
  was trained, so nothing is lost.
- During the steps (:func:`stepping`), the step in progress finishes, a checkpoint of it
  is written (``checkpoint.save_on_stop``) and the run ends at that step boundary. A step
  still *generating* ``checkpoint.stop_grace_s`` after the signal is abandoned instead: its
  prompts are drawn again on resume, and the checkpoint is of the last completed step. A
  step that is training, syncing weights or saving always finishes (the trainer's state is
  only consistent at a boundary).
- After the steps (charts, cleanup), the first signal is noted and the run ends normally.
- A second signal exits at once, without a checkpoint: every process started under
  rl-train (Ray's, the engines', the router's) is SIGKILLed, then the process exits
  (``os._exit``); Ray's agents would otherwise linger for a minute or so.

The run ends with :class:`RunInterrupted`; ``rl-train`` prints ``stopped at step N; last
checkpoint step M; continue with --resume`` and exits with 128 + the signal (143 for
SIGTERM, 130 for SIGINT).

Why :func:`ray_starting`: ``ray.init`` replaces the Python SIGTERM handler with its own
(``sys.exit``), and the driver's Ray core worker installs a C++ failure-signal handler for
SIGTERM that prints ``*** SIGTERM received ...`` and aborts (exit 134): the launcher's
handler never ran. Installing the Python handlers again once Ray has started puts
Python's C-level handler back in place, so the launcher's wins. (A Ctrl-C in a terminal
also reaches Ray's local head processes, which share the driver's process group; they
carry on, and are stopped with the run.)
"""

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunInterrupted(BaseException):
    """A stop signal ended the run. A BaseException (as KeyboardInterrupt), so that the
    ``except Exception`` of the code it interrupts does not take it for an error there."""

    def __init__(self, signum: int, *, step: int = 0, abandoned: int = 0):
        self.signum, self.step, self.abandoned = signum, step, abandoned
        super().__init__(f"{signal.Signals(signum).name} at step {step}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


@dataclass
class _State:
    """What the handlers know; changed only by the main thread (handlers run there)."""

    phase: str = "off"  # off | starting | stepping | finishing
    signum: int | None = None
    grace_s: float = 10.0
    generating: int = 0  # the step whose rollout runs now (0: none): it may be abandoned
    previous: dict = field(default_factory=dict)


_state = _State()


def install(grace_s: float) -> None:
    """Take SIGTERM and SIGINT for this run (main thread only); :func:`uninstall` undoes it."""
    global _state
    _state = _State(phase="starting", grace_s=grace_s)
    _state.previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    _state.previous[signal.SIGALRM] = signal.getsignal(signal.SIGALRM)
    _handle()


def _handle() -> None:
    for signum in SIGNALS:
        signal.signal(signum, _on_signal)
    signal.signal(signal.SIGALRM, _on_grace_over)


def uninstall() -> None:
    """Restore the handlers :func:`install` found, and forget the run."""
    global _state
    signal.setitimer(signal.ITIMER_REAL, 0)
    for signum, handler in _state.previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    _state = _State()


@contextlib.contextmanager
def ray_starting() -> Iterator[None]:
    """Around ``ray.init``: the run's handlers are put back afterwards, as Ray replaces
    them (see the module docstring)."""
    try:
        yield
    finally:
        if _state.phase != "off" and threading.current_thread() is threading.main_thread():
            _handle()


@contextlib.contextmanager
def stepping(run, save_fn, first_step: int) -> Iterator[None]:
    """The loop's steps, ``first_step`` on: a signal now ends the run at a step boundary
    (:func:`at_boundary`); a rollout abandoned after the grace period leaves a checkpoint
    of the last completed step."""
    run.extras["stop_steps"] = {"done": first_step - 1, "saved": first_step - 1}
    _enter("stepping")  # a signal during start-up has already stopped the run
    try:
        yield
    except RunInterrupted as stop:
        if stop.abandoned:
            stop.step = run.extras["stop_steps"]["done"]
            _save_last(run, save_fn)
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _enter("finishing")


def _enter(phase: str) -> None:
    if _state.phase != "off":
        _state.phase = phase


@contextlib.contextmanager
def generating(step: int) -> Iterator[None]:
    """Step ``step``'s rollout: the trainer still holds the last completed step, so the
    step may be abandoned here once the grace period is over."""
    _state.generating = step
    try:
        yield
    finally:
        _state.generating = 0


def at_boundary(run, step: int, save_fn, *, saved: bool) -> None:
    """After step ``step`` is recorded (and saved when ``saved``): when a signal came,
    save it (``checkpoint.save_on_stop``) and raise :class:`RunInterrupted`."""
    done = run.extras.setdefault("stop_steps", {"done": 0, "saved": 0})
    done["done"] = step
    if saved:
        done["saved"] = step
    if _state.signum is None or step == run.config.num_steps:  # the last one: the run is done
        return
    signal.setitimer(signal.ITIMER_REAL, 0)  # no abandoning while the checkpoint is written
    _save_last(run, save_fn)
    raise RunInterrupted(_state.signum, step=step)


def _save_last(run, save_fn) -> None:
    steps = run.extras["stop_steps"]
    if run.config.checkpoint.save_on_stop and steps["done"] > steps["saved"]:
        _say(f"saving a checkpoint of step {steps['done']} before stopping")
        save_fn(run, steps["done"])
        steps["saved"] = steps["done"]


def _on_signal(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    if _state.signum is not None:
        _say(f"second signal ({name}): exiting now, without a checkpoint")
        try:
            _kill_descendants()
        finally:
            os._exit(128 + signum)
    _state.signum = signum
    if _state.phase == "starting":
        _say(f"{name}: stopping the start-up (a second signal exits at once)")
        raise RunInterrupted(signum)
    if _state.phase == "finishing":
        _say(f"{name}: the run is finishing (a second signal exits at once)")
        return
    grace = _state.grace_s
    _say(
        f"{name}: stopping after this step; a step still generating after {grace:g} s "
        "(checkpoint.stop_grace_s) is abandoned; a second signal exits at once"
    )
    signal.setitimer(signal.ITIMER_REAL, max(grace, 1e-3))


def _on_grace_over(signum: int, frame) -> None:
    if _state.generating and _state.phase == "stepping":
        step = _state.generating
        _say(f"step {step} still generating after {_state.grace_s:g} s: abandoned")
        raise RunInterrupted(_state.signum or signal.SIGTERM, abandoned=step)
    if _state.phase == "stepping":
        _say("the step is past its rollout (training, weight sync or saving): it finishes first")


def _kill_descendants() -> None:
    """SIGKILL every process below this one (Linux ``/proc``; elsewhere nothing)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit():  # self, thread-self, sys, ...
            continue
        try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            with open(os.path.join(entry.path, "stat")) as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    below, parents = [], [os.getpid()]
    while parents:
        found = children.get(parents.pop(), [])
        below += found
        parents += found
    for pid in below:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _say(text: str) -> None:
    """One line on stderr from a signal handler: ``os.write``, as ``print`` may be in the
    middle of writing on the same stream (re-entering it raises RuntimeError)."""
    os.write(2, f"rl-train: {text}\n".encode())


def stopped_message(config, stop: RunInterrupted) -> str:
    """``stopped at step N; last checkpoint step M; continue with --resume``."""
    from rl_launcher.infra import checkpoints
    from rl_launcher.infra.faults import last_recorded_step

    name = signal.Signals(stop.signum).name
    step = stop.step or _recorded(config, last_recorded_step)
    where = f"stopped at step {step}" if step else "stopped before step 1"
    if stop.abandoned:
        where += f" (step {stop.abandoned} abandoned while generating)"
    done = checkpoints.complete_checkpoints(checkpoints.checkpoint_dir(config))
    if not done:
        return f"{where}; no checkpoint yet: --resume would start again at step 1 ({name})"
    last, path = done[-1]
    return f"{where}; last checkpoint step {last}; continue with --resume ({name}; {path})"


def _recorded(config, last_recorded_step) -> int:
    try:
        return last_recorded_step(config.logging.run_dir)
    except ValueError:  # no metrics.jsonl yet
        return 0
