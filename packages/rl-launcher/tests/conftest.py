"""Test-wide settings of rl-launcher's suite.

A local Ray starts in about 15 s on CI's loaded 2-core machine. The modules whose tests ask
for ``ray_cluster`` therefore run first, one after another, and share one Ray, shut down
before the other modules; a module that leaves actors or placement groups behind hands the
next one a fresh Ray."""

import os
import time
import warnings

import pytest

from rl_launcher.infra.ray_cluster import LOCAL_RAY_ENV

# Before any test module imports Ray: local Ray workers must not re-run `uv run` (see
# rl_launcher.infra.ray_cluster); this suite itself runs under `uv run ... tox`.
for _name, _value in LOCAL_RAY_ENV.items():
    os.environ.setdefault(_name, _value)

SHARED_RAY = "ray_cluster"
SHARED_MODULES = pytest.StashKey[set]()
LEFTOVER_WAIT_S = 10.0  # ray.kill returns before the GCS marks the actor dead


def pytest_collection_modifyitems(config, items):
    """Whole modules that use the shared Ray move to the front; all keep their own order."""
    shared = {item.module for item in items if SHARED_RAY in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: getattr(item, "module", None) not in shared)
    config.stash[SHARED_MODULES] = shared


@pytest.fixture(scope="session")
def _shared_ray_state():
    """Whether this session started the shared Ray; shut down at the end if so."""
    state = {"started": False}
    yield state
    _stop_shared_ray(state)


@pytest.fixture(scope="module", autouse=True)
def _no_shared_ray_elsewhere(request, _shared_ray_state):
    """The other modules start their own Ray, or none: the shared one is shut down first."""
    if request.module not in request.config.stash.get(SHARED_MODULES, set()):
        _stop_shared_ray(_shared_ray_state)


def _stop_shared_ray(state: dict) -> None:
    if state["started"]:
        import ray

        ray.shutdown()
        state["started"] = False


@pytest.fixture(scope="module")
def ray_cluster(request, _shared_ray_state):
    """One local Ray for the rl-train runs of every module that asks for it (they attach
    to it and leave it running). After the module, a Ray still holding live actors or
    placement groups is shut down, so the next module starts from an empty one."""
    import ray

    from rl_launcher.infra.ray_cluster import connect

    if not ray.is_initialized():
        _shared_ray_state["started"] = connect(None, num_cpus=4) == "started"
    yield
    if _shared_ray_state["started"] and ray.is_initialized() and (left := _left_behind()):
        left_by = request.module.__name__
        warnings.warn(f"{left_by} left {left} in the shared Ray: restarted", stacklevel=1)
        _stop_shared_ray(_shared_ray_state)


def _left_behind() -> list[str]:
    """Live actors and placement groups of the shared Ray, after a short wait for the
    ones being removed."""
    import ray

    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while True:
        actors = ray._private.state.actors(actor_state_name="ALIVE").values()
        groups = ray.util.placement_group_table().values()
        live = [a["ActorClassName"] for a in actors]
        live += [
            f"placement group {g['placement_group_id']}" for g in groups if g["state"] != "REMOVED"
        ]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.2)
