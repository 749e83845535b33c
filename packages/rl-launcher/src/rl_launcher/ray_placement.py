"""A :class:`~rl_launcher.placement.PlacementPlan` made real: one Ray placement group.

Ray numbers a placement group's bundles in the order they were asked for, not by node or
device. So after the group is ready, a probe task in every bundle reports its node and GPU
id, and bundles are sorted by (node, device): logical slot ``i`` of the plan maps to Ray
bundle ``bundle_indices[i]``. The sort is checked against the plan (as many devices per
node as configured), so a training rank's slot is the device the plan says it is.
"""

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_launcher.placement import PlacementPlan

_PROBE_GPUS = 0.01  # enough to be handed the bundle's GPU id, too little to crowd it


@dataclass(frozen=True, kw_only=True)
class OrderedPlacement:
    """``bundle_indices[slot]``: Ray bundle of plan slot ``slot``; ``node_ids`` and
    ``gpu_ids`` (None for CPU bundles) describe where each slot landed."""

    group: PlacementGroup
    bundle_indices: tuple[int, ...]
    node_ids: tuple[str, ...]
    gpu_ids: tuple[int | None, ...]
    use_gpu: bool

    def strategy(self, slot: int) -> PlacementGroupSchedulingStrategy:
        """Scheduling strategy that puts a task or actor into the bundle of ``slot``."""
        return PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=self.bundle_indices[slot],
            placement_group_capture_child_tasks=True,
        )

    def remove(self) -> None:
        remove_placement_group(self.group)


# max_calls=0: keep the worker after the task (GPU tasks otherwise get a fresh process each).
@ray.remote(num_cpus=0, max_calls=0)
def _probe() -> tuple[str, list[int]]:
    context = ray.get_runtime_context()
    return context.get_node_id(), [int(g) for g in ray.get_gpu_ids()]


def create_placement(
    plan: PlacementPlan,
    *,
    use_gpu: bool,
    cpus_per_bundle: float = 1.0,
    devices_per_node: int,
    timeout_s: float = 60.0,
) -> OrderedPlacement:
    """Reserve the plan's bundles (PACK) and order them by node and device."""
    if not use_gpu and cpus_per_bundle <= 0:
        raise ValueError("CPU bundles need cluster.cpus_per_bundle > 0")
    bundle = {"CPU": cpus_per_bundle, **({"GPU": 1} if use_gpu else {})}
    group = placement_group([dict(bundle) for _ in range(plan.num_bundles)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not reserve {plan.num_bundles} bundles of {bundle} within {timeout_s:.0f}s; "
            f"cluster resources: {ray.cluster_resources()}"
        )
    # One probe at a time: they reuse one worker per node instead of starting one per bundle.
    where = [
        ray.get(
            _probe.options(
                num_gpus=_PROBE_GPUS if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=b
                ),
            ).remote()
        )
        for b in range(plan.num_bundles)
    ]
    order = sorted(range(plan.num_bundles), key=lambda b: (where[b][0], where[b][1], b))
    placement = OrderedPlacement(
        group=group,
        bundle_indices=tuple(order),
        node_ids=tuple(where[b][0] for b in order),
        gpu_ids=tuple(where[b][1][0] if use_gpu else None for b in order),
        use_gpu=use_gpu,
    )
    _check_nodes(placement, plan, devices_per_node)
    return placement


def _check_nodes(placement: OrderedPlacement, plan: PlacementPlan, devices_per_node: int) -> None:
    """Slot i must sit on the (i // devices_per_node)-th node, as the plan assumes."""
    node_rank: dict[str, int] = {}
    for slot, node_id in enumerate(placement.node_ids):
        rank = node_rank.setdefault(node_id, len(node_rank))
        if rank != plan.slots[slot].node:
            placement.remove()
            raise RuntimeError(
                f"bundle of slot {slot} landed on node #{rank}, the plan expects node "
                f"#{plan.slots[slot].node}; the nodes do not hold cluster.devices_per_node="
                f"{devices_per_node} free devices each"
            )
