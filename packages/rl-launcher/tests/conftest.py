"""Test-wide settings of rl-launcher's suite."""

import os

from rl_launcher.ray_cluster import LOCAL_RAY_ENV

# Before any test module imports Ray: local Ray workers must not re-run `uv run` (see
# rl_launcher.ray_cluster); this suite itself runs under `uv run ... tox`.
for _name, _value in LOCAL_RAY_ENV.items():
    os.environ.setdefault(_name, _value)
