"""The code reward in real subprocesses: pass fraction, and that each limit actually fires."""

import os
import time

import pytest

from rl_rewards import get_reward
from rl_rewards.code import Limits, cases_from_label, extract_code, run_case
from rl_rewards.jail import PidsJail

pytestmark = pytest.mark.integration
FAST = Limits(timeout_s=2.0, memory_mb=256, max_output_bytes=100_000)
SOLUTION = "```python\ndef add(a, b):\n    return a + b\n```"


def test_pass_fraction_over_assert_tests():
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]
    assert get_reward("code", timeout_s=5)(SOLUTION, tests) == pytest.approx(2 / 3)


def test_stdin_stdout_cases():
    label = {"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5", "7"]}
    code = "a, b = map(int, input().split())\nprint(a + b)"
    assert get_reward("code")(code, label) == 0.5


def test_wall_clock_timeout_fires_and_kills_the_process_group(tmp_path):
    marker = tmp_path / "child_alive"
    child = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    code = (  # a grandchild that would create the marker after the parent is killed
        f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}])\n"
        "while True: pass"
    )
    start = time.monotonic()
    outcome = run_case(code, "pass", Limits(timeout_s=1.0))
    assert outcome == outcome.__class__(False, "timeout", "")
    assert time.monotonic() - start < 3.0
    time.sleep(3.5)
    assert not marker.exists()  # the whole session was killed, grandchild included


def test_background_processes_do_not_outlive_a_passing_test(tmp_path):
    marker = tmp_path / "leftover"
    child = f"import time; time.sleep(1.5); open({str(marker)!r}, 'w')"
    code = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}])"
    assert run_case(code, "pass", FAST).passed
    time.sleep(2.0)
    assert not marker.exists()


def test_memory_cap_fires():
    outcome = run_case("blob = bytearray(600 * 1024 * 1024)", "pass", FAST)
    assert not outcome.passed and outcome.reason == "memory limit"
    assert run_case("blob = bytearray(10 * 1024 * 1024)", "pass", FAST).passed


def test_output_cap_fires():
    code = "import sys\nwhile True: sys.stdout.write('x' * 10000)"
    outcome = run_case(code, "pass", FAST)
    assert not outcome.passed and outcome.reason == "output limit"


def test_cpu_limit_fires_for_a_busy_loop_under_a_long_wall_timeout():
    outcome = run_case("while True: pass", "pass", Limits(timeout_s=1.0))
    assert not outcome.passed and outcome.reason in ("timeout", "cpu limit")


def test_temporary_directory_is_deleted(tmp_path):
    code = "import os\nopen('scratch.txt', 'w').write('x')\nassert os.path.exists('scratch.txt')"
    assert get_reward("code", workdir_root=str(tmp_path))(code, ["pass"]) == 1.0
    assert os.listdir(tmp_path) == []


def test_harness_environment_is_isolated():
    code = "import os\nassert 'HOME' not in os.environ and os.getcwd().startswith('/')"
    assert run_case(code, "pass", FAST).passed


def test_extract_code_and_label_errors():
    assert extract_code("x\n```python\na = 1\n```\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("print(1)") == "print(1)"
    with pytest.raises(ValueError, match="assert snippets"):
        cases_from_label(42)
    with pytest.raises(ValueError, match="same length"):
        cases_from_label({"inputs": ["1"], "outputs": []})


# ---- escapes: each is stopped and scores 0 ---------------------------------------------
def _nobody_left(marker: str) -> bool:
    """No process whose command line holds ``marker`` is still alive."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rpartition(")")[2][:3] == " Z "
        except OSError:
            continue
        if marker.encode() in cmdline and not zombie:
            return False
    return True


def test_fork_bomb_is_stopped_and_scores_zero():
    # children that leave the session and ignore fork failures: only a process limit and
    # a kill of every process of the test (the pids cgroup, where available) stop them
    bomb = (
        "import os, time  # fork-bomb-marker\n"
        "while True:\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"
        "    except OSError:\n"
        "        time.sleep(0.01)\n"
    )
    start = time.monotonic()
    limits = Limits(timeout_s=1.5, max_processes=16)
    assert get_reward("code", timeout_s=1.5)(bomb, ["pass"]) == 0.0
    outcome = run_case(bomb, "pass", limits)
    assert not outcome.passed and outcome.reason in ("timeout", "cpu limit")
    assert time.monotonic() - start < 20
    probe = PidsJail.create(1)
    if probe is not None:  # a cgroup could be made: nothing may survive
        probe.close()
        time.sleep(0.2)
        assert _nobody_left("fork-bomb-marker")


def test_huge_allocation_is_stopped_and_scores_zero():
    code = "blob = b'x' * (4 * 1024**3)"
    assert get_reward("code", memory_mb=256)(code, ["pass"]) == 0.0
    assert run_case(code, "pass", FAST).reason == "memory limit"


def test_huge_file_is_stopped_and_scores_zero():
    code = "with open('big.bin', 'wb') as f:\n    while True: f.write(b'x' * 65536)"
    assert get_reward("code", max_output_bytes=100_000)(code, ["pass"]) == 0.0
    assert run_case(code, "pass", FAST).reason == "output limit"


@pytest.mark.parametrize(
    "write",
    [
        "open({target!r}, 'w').write('pwned')",
        "import os; os.close(os.open({target!r}, os.O_WRONLY | os.O_CREAT))",
        "import pathlib; pathlib.Path({target!r}).write_text('pwned')",
        "import shutil; shutil.copy(__file__, {target!r})",
        "import os; open('x', 'w').close(); os.rename('x', {target!r})",
        "import ctypes; ctypes.CDLL(None).creat({target!r}.encode(), 0o644)",
    ],
)
def test_writing_outside_the_scratch_dir_is_stopped_and_scores_zero(tmp_path, write):
    target = str(tmp_path / "escaped.txt")
    code = write.format(target=target)
    assert get_reward("code")(code, ["pass"]) == 0.0
    outcome = run_case(code, "pass", FAST)
    assert outcome.reason == "sandbox violation" and not os.path.exists(target)


def test_writing_inside_the_scratch_dir_and_reading_outside_still_work():
    code = (
        "import os, tempfile\n"
        "open('a.txt', 'w').write('1'); os.mkdir('d'); os.rename('a.txt', 'd/b.txt')\n"
        "with tempfile.NamedTemporaryFile('w') as f: f.write('t')\n"
        "assert open('/etc/hostname').read() is not None"
    )
    assert run_case(code, "pass", FAST).passed
