"""The ``code`` reward: run the response's Python against tests in a sandboxed subprocess.

Each test runs in its own ``python -I`` process with a fresh scratch directory as its cwd
and TMPDIR (deleted afterwards), in a new session (the whole process group is killed
on timeout), with limits set by ``resource`` before exec: address space (memory), CPU
seconds, size of any file written (stdout goes to a file, so this also caps output), number
of processes, no core dumps. An audit hook refuses writes outside the scratch directory
and ctypes. Where a pids cgroup can be made (root), the test runs in its own: the
process limit then binds root too, and every process of the test is killed at the end
(see :mod:`rl_rewards.jail`). The harness itself opens no network connection. Score =
fraction of tests passed.

Label: a list of assert-style snippets, ``{"tests": [...]}``, or stdin/stdout cases
``{"inputs": [...], "outputs": [...]}`` (outputs compared after stripping whitespace).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rl_rewards.jail import PidsJail
from rl_rewards.registry import register_reward

_FENCE_RE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.S)


@dataclass(frozen=True)
class Limits:
    """Per-test sandbox limits."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = 1_000_000
    max_processes: int = 64


@dataclass(frozen=True)
class CaseOutcome:
    """``passed``, and why not: "", "timeout", "exit code N", "wrong output", ..."""

    passed: bool
    reason: str = ""
    stderr_tail: str = ""


def extract_code(response: str) -> str:
    """The last fenced Python block of the response, or the whole response if unfenced."""
    blocks = _FENCE_RE.findall(response)
    return blocks[-1] if blocks else response


# Runs before the response's code, in its interpreter: an audit hook (it cannot be removed)
# refuses writes, renames, deletions and links outside the scratch directory, and ctypes.
_GUARD = r"""
import os, sys
_scratch = os.path.realpath(sys.argv[1])
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link",
                "os.truncate", "os.chmod", "os.chown", "os.utime", "shutil.rmtree"}
def _inside(path):
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(path))
    return real == _scratch or real.startswith(_scratch + os.sep)
def _hook(event, args):
    if event == "open" and args[0] is not None and (
            any(c in str(args[1] or "") for c in "wax+") or (args[2] or 0) & _WRITE):
        paths = args[:1]
    elif event in _PATH_EVENTS:
        paths = [a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
    elif event.startswith("ctypes."):
        raise PermissionError(f"sandbox: {event} is not allowed")
    else:
        return
    for path in paths:
        if not _inside(path):
            raise PermissionError(f"sandbox: {event} outside the scratch directory: {path}")
sys.addaudithook(_hook)
script = sys.argv[2]
sys.argv = [script]
import runpy
runpy.run_path(script, run_name="__main__")
"""


def _set_limits(limits: Limits) -> None:  # runs in the child between fork and exec
    import resource

    memory = limits.memory_mb * 1024 * 1024
    cpu = math.ceil(limits.timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_output_bytes,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _kill_session(process: subprocess.Popen) -> None:
    """Kill everything the test started (its session), then reap the main process."""
    with contextlib.suppress(ProcessLookupError):  # raised when the session is already empty
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_sandboxed(source: str, stdin: str, limits: Limits, workdir_root: str | None = None):
    """Run ``source`` under ``limits``; (exit code or None on timeout, stdout, stderr)."""
    with tempfile.TemporaryDirectory(prefix="rl-rewards-code-", dir=workdir_root) as root:
        scratch = Path(root) / "scratch"  # the only place the code may write
        scratch.mkdir()
        script, out_path, err_path = (Path(root) / n for n in ("main.py", "out", "err"))
        script.write_text(source, encoding="utf-8")
        env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(scratch)}
        jail = PidsJail.create(limits.max_processes)

        def setup_child():  # between fork and exec
            _set_limits(limits)
            if jail is not None:
                jail.enter()

        with out_path.open("wb") as out, err_path.open("wb") as err:
            process = subprocess.Popen(
                [os.path.abspath(sys.executable), "-I", "-B", "-c", _GUARD, scratch, script],
                cwd=scratch,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                start_new_session=True,
                env=env,
                preexec_fn=setup_child,
            )
            try:
                process.communicate(stdin.encode(), timeout=limits.timeout_s)
                code = process.returncode
            except subprocess.TimeoutExpired:
                code = None
            _kill_session(process)
            if jail is not None:
                jail.close()
        read = limits.max_output_bytes
        return (
            code,
            out_path.read_bytes()[:read].decode(errors="replace"),
            err_path.read_bytes()[-2000:].decode(errors="replace"),
        )


def _describe_failure(code: int | None, stderr: str) -> str:
    if code is None:
        return "timeout"
    if "MemoryError" in stderr:
        return "memory limit"
    if code == -signal.SIGXFSZ or "File too large" in stderr:
        return "output limit"
    if code == -signal.SIGXCPU:
        return "cpu limit"
    if "PermissionError: sandbox:" in stderr:
        return "sandbox violation"
    return f"exit code {code}"


def run_case(
    code: str, test: str | tuple[str, str], limits: Limits, workdir_root=None
) -> CaseOutcome:
    """One assert snippet (str) or one (stdin, expected stdout) pair."""
    if isinstance(test, str):
        exit_code, _, stderr = run_sandboxed(f"{code}\n\n{test}\n", "", limits, workdir_root)
        if exit_code == 0:
            return CaseOutcome(True)
        return CaseOutcome(False, _describe_failure(exit_code, stderr), stderr)
    stdin, expected = test
    exit_code, stdout, stderr = run_sandboxed(code, stdin, limits, workdir_root)
    if exit_code != 0:
        return CaseOutcome(False, _describe_failure(exit_code, stderr), stderr)
    passed = stdout.strip() == expected.strip()
    return CaseOutcome(passed, "" if passed else "wrong output", stderr)


def cases_from_label(label: object) -> list[str | tuple[str, str]]:
    """Normalise the label forms of the module docstring to a list of tests."""
    if isinstance(label, dict) and "tests" in label:
        label = label["tests"]
    if isinstance(label, dict) and "inputs" in label and "outputs" in label:
        if len(label["inputs"]) != len(label["outputs"]):
            raise ValueError("code label: 'inputs' and 'outputs' must have the same length")
        return [(str(i), str(o)) for i, o in zip(label["inputs"], label["outputs"], strict=True)]
    if isinstance(label, list | tuple) and label and all(isinstance(t, str) for t in label):
        return list(label)
    raise ValueError(
        "code label must be a list of assert snippets, {'tests': [...]}, or "
        f"{{'inputs': [...], 'outputs': [...]}}; got {type(label).__name__}"
    )


@register_reward(
    "code", "Python in a sandboxed subprocess (timeout, memory/CPU/output caps); pass fraction"
)
def code_reward(
    response: str,
    label: object,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 1_000_000,
    workdir_root: str | None = None,
) -> float:
    """Fraction of the label's tests that the response's code passes."""
    tests = cases_from_label(label)
    limits = Limits(timeout_s, memory_mb, max_output_bytes)
    code = extract_code(response)
    return sum(run_case(code, t, limits, workdir_root).passed for t in tests) / len(tests)
