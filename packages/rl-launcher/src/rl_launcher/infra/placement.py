"""The device layout of a run, on paper: which bundle each training rank and engine uses.

Bundles are the devices of the placement group in node-major, device-minor order
(slot ``i`` is device ``i % devices_per_node`` of node ``i // devices_per_node``).
Colocated: training ranks and engines both start at bundle 0 and share devices, taking
turns. Disaggregated: training takes the first bundles, engines the ones after.
An engine never straddles nodes unless it spans whole nodes.
:mod:`rl_launcher.infra.ray_placement` turns a plan into a Ray placement group.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    node: int
    device: int


@dataclass(frozen=True, kw_only=True)
class PlacementPlan:
    """``train_bundles[r]``: bundle of training rank r; ``engine_bundles[e]``: bundles of
    engine e (its tensor-parallel group); ``slots[b]``: where bundle b lives."""

    slots: tuple[Slot, ...]
    train_bundles: tuple[int, ...]
    engine_bundles: tuple[tuple[int, ...], ...]
    colocate: bool

    @property
    def num_bundles(self) -> int:
        return len(self.slots)

    @property
    def num_train_ranks(self) -> int:
        return len(self.train_bundles)

    def engine_parts(self, engine: int) -> list[tuple[int, ...]]:
        """Engine ``engine``'s bundles node by node: one part, or one per node of an
        engine that spans whole nodes (SGLang's ``--nnodes``; part r is node rank r)."""
        parts: dict[int, list[int]] = {}
        for bundle in self.engine_bundles[engine]:
            parts.setdefault(self.slots[bundle].node, []).append(bundle)
        return [tuple(bundles) for bundles in parts.values()]

    def describe(self, *, engines: bool = True) -> str:
        """One line per node: which roles use each of its devices (T3 = rank 3, E1 = engine
        1); ``engines`` False leaves engines out (a run that starts none, e.g. SFT)."""
        roles: dict[int, list[str]] = {b: [] for b in range(self.num_bundles)}
        for rank, bundle in enumerate(self.train_bundles):
            roles[bundle].append(f"T{rank}")
        for engine, bundles in enumerate(self.engine_bundles if engines else ()):
            for bundle in bundles:
                roles[bundle].append(f"E{engine}")
        lines: dict[int, list[str]] = {}
        for bundle, slot in enumerate(self.slots):
            lines.setdefault(slot.node, []).append("+".join(roles[bundle]) or "-")
        return "\n".join(f"node {node}: {' '.join(cells)}" for node, cells in lines.items())


def plan_layout(
    *,
    num_nodes: int,
    devices_per_node: int,
    num_engines: int,
    devices_per_engine: int,
    colocate: bool,
    num_train_ranks: int | None = None,
) -> PlacementPlan:
    """Assign bundles to training ranks and engines; ValueError when the pool is too small."""
    total = num_nodes * devices_per_node
    engine_devices = num_engines * devices_per_engine
    if num_train_ranks is None:
        num_train_ranks = total if colocate else total - engine_devices
    needed = max(num_train_ranks, engine_devices) if colocate else num_train_ranks + engine_devices
    if num_train_ranks < 1 or needed > total:
        raise ValueError(_too_small(total, num_train_ranks, engine_devices, colocate))
    engine_start = 0 if colocate else num_train_ranks
    engines = tuple(
        tuple(
            range(
                engine_start + e * devices_per_engine, engine_start + (e + 1) * devices_per_engine
            )
        )
        for e in range(num_engines)
    )
    slots = tuple(Slot(b // devices_per_node, b % devices_per_node) for b in range(needed))
    for engine, bundles in enumerate(engines):
        _check_engine_nodes(engine, bundles, slots, devices_per_node)
    return PlacementPlan(
        slots=slots,
        train_bundles=tuple(range(num_train_ranks)),
        engine_bundles=engines,
        colocate=colocate,
    )


def _too_small(total: int, num_train_ranks: int, engine_devices: int, colocate: bool) -> str:
    pool = "shared by" if colocate else "split between"
    return (
        f"cluster has {total} devices (cluster.num_nodes x cluster.devices_per_node) "
        f"{pool} {num_train_ranks} training ranks (backend.num_ranks) and {engine_devices} "
        "engine devices (engine.num_engines x engine.devices_per_engine); add devices or "
        "shrink the layout"
    )


def _check_engine_nodes(
    engine: int, bundles: tuple[int, ...], slots: tuple[Slot, ...], devices_per_node: int
) -> None:
    nodes = {slots[b].node for b in bundles}
    spans_whole_nodes = len(bundles) % devices_per_node == 0 and slots[bundles[0]].device == 0
    if len(nodes) > 1 and not spans_whole_nodes:
        raise ValueError(
            f"engine {engine} would straddle nodes {sorted(nodes)} (bundles {list(bundles)}); "
            "make engine.devices_per_engine divide cluster.devices_per_node and the training "
            "ranks fill whole engines' worth of devices"
        )


def plan_from_config(config) -> PlacementPlan:
    """The plan of a :class:`~rl_launcher.config.TrainConfig`."""
    return plan_layout(
        num_nodes=config.cluster.num_nodes,
        devices_per_node=config.cluster.devices_per_node,
        num_engines=config.engine.num_engines,
        devices_per_engine=config.engine.devices_per_engine,
        colocate=config.cluster.colocate,
        num_train_ranks=config.backend.num_ranks,
    )
