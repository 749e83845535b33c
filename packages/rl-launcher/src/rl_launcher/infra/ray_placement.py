"""A :class:`~rl_launcher.infra.placement.PlacementPlan` made real: one Ray placement group whose
bundles sit on the nodes the plan says.

Before anything is reserved, :func:`choose_nodes` gives each node of the plan a Ray node
large enough for its bundles (the driver's own node first, when it is large enough, so a
one-node run stays on it); a cluster with too few such nodes is refused at once, naming
every node and what it lacks. Each bundle then carries a label selector on its node's id
(``ray.io/node-id``), so Ray cannot pack the bundles of two plan nodes onto one machine.
Ray numbers a group's bundles in the order they were asked for, not by device: after the
group is ready a probe task in every bundle reports its node and GPU id, and bundles are
sorted by (plan node, GPU id): logical slot ``i`` of the plan maps to Ray bundle
``bundle_indices[i]``, on the node the plan gives slot ``i``.
"""

import ipaddress
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_launcher.infra.placement import PlacementPlan

_PROBE_GPUS = 0.01  # enough to be handed the bundle's GPU id, too little to crowd it
NODE_ID_LABEL = "ray.io/node-id"  # a label every Ray node carries: its node id


class ClusterTooSmall(ValueError, RuntimeError):
    """The cluster has fewer nodes able to hold the plan's bundles than the plan has nodes.
    A ValueError (the layout options do not fit: rl-train exits 2 with the message) and a
    RuntimeError (Ray cannot reserve the bundles, as when they do not come within the
    time limit)."""


@dataclass(frozen=True)
class RayNode:
    """One alive Ray node: its id, address and total resources."""

    node_id: str
    address: str
    resources: dict

    def describe(self) -> str:
        """``127.0.0.2 (CPU 2, GPU 8)``: its address and the resources a bundle may take."""
        held = [
            f"{name} {self.resources[name]:g}"
            for name in ("CPU", "GPU")
            if self.resources.get(name)
        ]
        return f"{self.address} ({', '.join(held) or 'no CPU'})"


@dataclass(frozen=True, kw_only=True)
class OrderedPlacement:
    """``bundle_indices[slot]``: Ray bundle of plan slot ``slot``; ``node_ids``,
    ``node_addresses`` and ``gpu_ids`` (None for CPU bundles) say where each slot landed."""

    group: PlacementGroup
    bundle_indices: tuple[int, ...]
    node_ids: tuple[str, ...]
    gpu_ids: tuple[int | None, ...]
    use_gpu: bool
    node_addresses: tuple[str, ...] = ()

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
    """Reserve the plan's bundles, each on its plan node's Ray node (:func:`choose_nodes`),
    and order them by node and device."""
    if not use_gpu and cpus_per_bundle <= 0:
        raise ValueError("CPU bundles need cluster.cpus_per_bundle > 0")
    bundle = {"CPU": cpus_per_bundle, **({"GPU": 1} if use_gpu else {})}
    nodes = choose_nodes(plan, bundle, devices_per_node=devices_per_node)
    selectors = [{NODE_ID_LABEL: nodes[slot.node].node_id} for slot in plan.slots]
    group = placement_group(
        [dict(bundle) for _ in range(plan.num_bundles)],
        strategy="PACK",
        bundle_label_selector=selectors,
    )
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"Ray could not reserve {plan.num_bundles} bundles of {bundle} within {timeout_s:.0f}s "
            f"on nodes {', '.join(n.address for n in nodes)} (other jobs may hold them); "
            f"cluster resources: {ray.cluster_resources()}"
        )
    where = _probe_bundles(group, plan.num_bundles, use_gpu)
    order = sorted(range(plan.num_bundles), key=lambda b: (plan.slots[b].node, where[b][1], b))
    placement = OrderedPlacement(
        group=group,
        bundle_indices=tuple(order),
        node_ids=tuple(where[b][0] for b in order),
        gpu_ids=tuple(where[b][1][0] if use_gpu else None for b in order),
        use_gpu=use_gpu,
        node_addresses=tuple(nodes[plan.slots[b].node].address for b in order),
    )
    _check_nodes(placement, plan, [n.node_id for n in nodes])
    return placement


def _probe_bundles(group: PlacementGroup, num_bundles: int, use_gpu: bool) -> list:
    """``(node id, GPU ids)`` of every Ray bundle of ``group``, in Ray's order. One probe
    at a time: they reuse one worker per node instead of starting one per bundle."""
    return [
        ray.get(
            _probe.options(
                num_gpus=_PROBE_GPUS if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=b
                ),
            ).remote()
        )
        for b in range(num_bundles)
    ]


def alive_nodes() -> list[RayNode]:
    """The cluster's alive nodes, the driver's first, then by address."""
    here = ray.get_runtime_context().get_node_id()
    nodes = [
        RayNode(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"]))
        for n in ray.nodes()
        if n["Alive"]
    ]
    return sorted(nodes, key=lambda n: (n.node_id != here, _address_key(n.address), n.node_id))


def _address_key(address: str) -> tuple:
    try:
        return (0, ipaddress.ip_address(address))
    except ValueError:  # a host name
        return (1, address)


def choose_nodes(plan: PlacementPlan, bundle: dict, *, devices_per_node: int) -> list[RayNode]:
    """A distinct alive Ray node for each node of the plan, able to hold that node's bundles
    (``bundle`` each); :class:`ClusterTooSmall` naming every node when there are too few."""
    needs = [sum(1 for s in plan.slots if s.node == k) for k in range(plan.slots[-1].node + 1)]
    free = alive_nodes()
    chosen = []
    for count in needs:
        fits = next((n for n in free if _holds(n, bundle, count)), None)
        if fits is None:
            raise ClusterTooSmall(_too_small(plan, bundle, needs, devices_per_node))
        free.remove(fits)
        chosen.append(fits)
    return chosen


def _holds(node: RayNode, bundle: dict, count: int) -> bool:
    return all(node.resources.get(name, 0) >= amount * count for name, amount in bundle.items())


def _too_small(plan: PlacementPlan, bundle: dict, needs: list[int], devices_per_node: int) -> str:
    per_node = ", ".join(f"{name} {amount * max(needs):g}" for name, amount in bundle.items())
    nodes = alive_nodes()
    able = [n.describe() for n in nodes if _holds(n, bundle, max(needs))]
    short = [n.describe() for n in nodes if not _holds(n, bundle, max(needs))]
    return (
        f"Ray could not reserve {plan.num_bundles} bundles of {bundle}: the plan needs "
        f"{len(needs)} node(s) with {per_node} each (cluster.num_nodes x "
        f"cluster.devices_per_node={devices_per_node} bundles) and the cluster has "
        f"{len(able)}{': ' + ', '.join(able) if able else ''}"
        f"{'; too small: ' + ', '.join(short) if short else ''}. Add nodes, or lower "
        "cluster.num_nodes / cluster.devices_per_node (nodes larger than needed are fine)"
    )


def _check_nodes(placement: OrderedPlacement, plan: PlacementPlan, chosen: list[str]) -> None:
    """Slot i must sit on the Ray node chosen for its plan node (the label selectors say
    so; checked, as everything after relies on it)."""
    for slot, node_id in enumerate(placement.node_ids):
        if node_id != chosen[plan.slots[slot].node]:
            placement.remove()
            raise RuntimeError(
                f"bundle of slot {slot} landed on node {node_id[:12]}, not on the node chosen "
                f"for plan node #{plan.slots[slot].node} ({chosen[plan.slots[slot].node][:12]})"
            )


def describe_layout(
    plan: PlacementPlan, placement: OrderedPlacement, *, engines: bool = True
) -> str:
    """The plan's line per node (:meth:`PlacementPlan.describe`: T<r> training rank r, E<e>
    engine e, one cell per device) with the Ray node it landed on, for the start-up log:
    ``node 1 at 10.0.0.7 (8f0c2b7d11e4): T1+E1``; the driver's node is marked."""
    driver = ray.get_runtime_context().get_node_id()
    first_slot = {slot.node: i for i, slot in reversed(list(enumerate(plan.slots)))}
    lines = []
    for line in plan.describe(engines=engines).splitlines():
        head, cells = line.split(": ", 1)
        slot = first_slot[int(head.removeprefix("node "))]
        node_id = placement.node_ids[slot]
        address = placement.node_addresses[slot] if placement.node_addresses else "?"
        mark = ", the driver's" if node_id == driver else ""
        lines.append(f"{head} at {address} ({node_id[:12]}{mark}): {cells}")
    return "\n".join(lines)
