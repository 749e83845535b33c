"""A config is loaded and checked without torch: ``rl-train --help``, ``--print-config`` and
a refused config answer in a fraction of a second, and the driver imports torch only once
the run starts (issue 21: 2.3 s of a small CPU run's start-up went to the config importing
torch through rl-core's registries)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ["torch", "numpy", "transformers", "ray", "pyarrow"]
SCRIPT = f"""
import sys
from rl_launcher.config.loader import load_config
for argv in ([], ["--config", "examples/quickstart/config.yaml"],
             ["--algorithm.policy_loss", "cispo", "--algorithm.loss_agg_mode",
              "seq-mean-token-sum-norm", "--rollout.data_plane", "workers"]):
    load_config(argv)
try:
    load_config(["--algorithm.advantage_estimator", "grp0"])
except ValueError as error:
    print(error)
print(sorted({{name.split(".")[0] for name in sys.modules}} & set({HEAVY!r})))
"""


def test_loading_and_checking_a_config_imports_nothing_heavy():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, check=True
    )
    refusal, loaded = result.stdout.strip().splitlines()
    assert "algorithm.advantage_estimator" in refusal and "grpo" in refusal  # the suggestion
    assert loaded == "[]"
