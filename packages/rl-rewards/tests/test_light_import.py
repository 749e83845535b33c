"""rl_rewards stays light: importing every submodule loads no torch, ray or sibling package."""

import subprocess
import sys

FORBIDDEN = [
    "torch",
    "ray",
    "transformers",
    "rl_core",
    "rl_sglang",
    "rl_fsdp",
    "rl_megatron",
    "rl_launcher",
    "pyarrow",
    "numpy",
]
SCRIPT = f"""
import importlib, pkgutil, sys
import rl_rewards
for info in pkgutil.walk_packages(rl_rewards.__path__, prefix="rl_rewards."):
    importlib.import_module(info.name)
rl_rewards.list_rewards()
loaded = {{name.split(".")[0] for name in sys.modules}}
print(sorted(loaded & set({FORBIDDEN!r})))
"""


def test_importing_everything_loads_nothing_heavy():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
