"""Test-wide settings of rl-launcher's suite."""

import os

import pytest

from rl_launcher.infra.ray_cluster import LOCAL_RAY_ENV

# Before any test module imports Ray: local Ray workers must not re-run `uv run` (see
# rl_launcher.infra.ray_cluster); this suite itself runs under `uv run ... tox`.
for _name, _value in LOCAL_RAY_ENV.items():
    os.environ.setdefault(_name, _value)


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray for a module's rl-train runs (they attach to it and leave it
    running); shut down after the module if this fixture started it."""
    from rl_launcher.infra.ray_cluster import connect

    started = connect(None, num_cpus=4) == "started"
    yield
    if started:
        import ray

        ray.shutdown()
