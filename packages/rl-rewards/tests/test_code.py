"""The code reward in real subprocesses: pass fraction, and that each limit actually fires."""

import os
import time

import pytest

from rl_rewards import get_reward
from rl_rewards.code import Limits, cases_from_label, extract_code, run_case

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
