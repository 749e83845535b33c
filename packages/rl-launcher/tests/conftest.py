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


def pytest_collection_modifyitems(config, items):
    """In pytest-xdist's workers (tox's launcher env, ``--no-loadscope-reorder``) the files
    with integration tests are handed out first: each takes tens of seconds, so one started
    last would keep its worker running long after the others ran out of files; the many
    quick files fill the end instead. A stable sort: each file keeps its own order."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    slow = {item.path for item in items if item.get_closest_marker("integration")}
    items.sort(key=lambda item: item.path not in slow)
