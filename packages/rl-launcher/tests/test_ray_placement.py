"""Real local Ray with 8 fake GPUs: bundles ordered by device, colocated roles share a GPU,
disaggregated roles do not. Ray starts once for this module."""

import os

import pytest

ray = pytest.importorskip("ray")

from rl_launcher.infra.placement import plan_layout  # noqa: E402
from rl_launcher.infra.ray_placement import create_placement  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(
        num_cpus=4,
        num_gpus=8,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()


@ray.remote(num_cpus=0, max_calls=0)
def visible_gpus():
    return ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")


@ray.remote(num_cpus=0)
class Rank:
    def gpu(self):
        return [int(g) for g in ray.get_gpu_ids()]


def gpus_of(placement, requests):
    """GPU ids seen by a task in each (slot, GPU fraction) of ``requests``, run concurrently."""
    refs = [
        visible_gpus.options(
            num_gpus=fraction, scheduling_strategy=placement.strategy(slot)
        ).remote()
        for slot, fraction in requests
    ]
    seen = []
    for ids, env in ray.get(refs):
        assert env == ",".join(str(i) for i in ids)  # what a CUDA process in that slot would see
        seen.append([int(i) for i in ids])
    return seen


def test_one_node_eight_gpus_colocated():
    plan = plan_layout(
        num_nodes=1, devices_per_node=8, num_engines=4, devices_per_engine=2, colocate=True
    )
    placement = create_placement(plan, use_gpu=True, cpus_per_bundle=0.25, devices_per_node=8)
    try:
        assert sorted(placement.bundle_indices) == list(range(8))
        assert (
            list(placement.gpu_ids) == sorted(placement.gpu_ids)
            and len(set(placement.gpu_ids)) == 8
        )
        assert len(set(placement.node_ids)) == 1
        # training rank r (0.4 GPU) and the engine holding slot r (0.2 GPU) share one GPU
        ranks = gpus_of(placement, [(slot, 0.4) for slot in plan.train_bundles])
        engines = gpus_of(
            placement, [(slot, 0.2) for slots in plan.engine_bundles for slot in slots]
        )
        assert ranks == engines == [[g] for g in placement.gpu_ids]
        actors = [
            Rank.options(num_gpus=0.4, scheduling_strategy=placement.strategy(s)).remote()
            for s in (0, 7)
        ]
        assert ray.get([a.gpu.remote() for a in actors]) == [
            [placement.gpu_ids[0]],
            [placement.gpu_ids[7]],
        ]
        for actor in actors:
            ray.kill(actor)
    finally:
        placement.remove()


def test_one_node_eight_gpus_disaggregated():
    plan = plan_layout(
        num_nodes=1, devices_per_node=8, num_engines=2, devices_per_engine=2, colocate=False
    )
    placement = create_placement(plan, use_gpu=True, cpus_per_bundle=0.25, devices_per_node=8)
    try:
        train = {
            g for ids in gpus_of(placement, [(s, 1.0) for s in plan.train_bundles]) for g in ids
        }
        engines = [
            {g for ids in gpus_of(placement, [(s, 1.0) for s in slots]) for g in ids}
            for slots in plan.engine_bundles
        ]
        assert len(train) == 4 and all(len(e) == 2 for e in engines)
        assert train.isdisjoint(engines[0] | engines[1]) and engines[0].isdisjoint(engines[1])
        assert train | engines[0] | engines[1] == set(range(8))
    finally:
        placement.remove()


def test_cpu_bundles_and_a_pool_too_small():
    plan = plan_layout(
        num_nodes=1, devices_per_node=2, num_engines=1, devices_per_engine=1, colocate=True
    )
    placement = create_placement(plan, use_gpu=False, cpus_per_bundle=1.0, devices_per_node=2)
    try:
        assert placement.gpu_ids == (None, None) and sorted(placement.bundle_indices) == [0, 1]
    finally:
        placement.remove()
    too_big = plan_layout(
        num_nodes=1, devices_per_node=16, num_engines=1, devices_per_engine=1, colocate=True
    )
    with pytest.raises(RuntimeError, match="could not reserve 16 bundles"):
        create_placement(
            too_big, use_gpu=True, cpus_per_bundle=0.1, devices_per_node=16, timeout_s=2
        )
