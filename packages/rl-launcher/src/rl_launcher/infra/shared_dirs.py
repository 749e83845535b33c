"""Directories several nodes use, checked at start-up when the run spans nodes.

On one node any directory will do. Across nodes, each of these must be the same directory
on every node that uses it (NFS, Lustre, a shared volume mounted at the same path):

- ``logging.run_dir``: the starting model built there is read by every training rank and
  engine; the driver writes metrics and the run state beside it.
- ``checkpoint.dir``: every training rank writes its own shards, the driver then writes
  ``state.json`` and ``manifest.json`` next to them.
- ``engine.weight_sync_dir`` (``engine.weight_sync: disk``): training rank 0 writes the
  weights, every engine reads them.
- ``model.path``: read by every training rank and engine (only read, so only compared).

The driver writes a probe file holding a random token; a task on each node reads it and
writes its own file back, which the driver then reads (for ``model.path``, each node's
``config.json`` is compared with the driver's). A node that cannot is a ValueError naming
the option, the node and what it saw, before the first step instead of at the first
checkpoint or weight sync.
"""

import uuid
from pathlib import Path

PROBE_PREFIX = ".shared-probe-"
PROBE_TIMEOUT_S = 120.0  # a node starts a worker process for its probe task


def probe_node(directory: str, token: str, node_id: str, compare: str | None) -> str | None:
    """On one node (a Ray task): None when ``directory`` is the driver's, else what this
    node found. ``compare``: a file to compare with the driver's bytes (read-only use);
    else read the driver's token file and write this node's own."""
    import hashlib

    path = Path(directory)
    try:
        if compare is not None:
            digest = hashlib.sha256((path / compare).read_bytes()).hexdigest()
            return None if digest == token else f"its {compare} differs from the driver's"
        seen = (path / f"{PROBE_PREFIX}{token}").read_text()
        (path / f"{PROBE_PREFIX}{token}-{node_id}").write_text(token)
    except OSError as error:
        return f"{error.strerror or error}: {error.filename}"
    return None if seen == token else "the driver's probe file holds something else"


def run_nodes(run) -> tuple[set[str], set[str], set[str]]:
    """Node ids of the training ranks, of rank 0 and the engines, and of the whole run,
    from the placement (before anything starts on them)."""
    plan, node_ids = run.plan, run.placement.node_ids
    ranks = {node_ids[b] for b in plan.train_bundles}
    engines = {node_ids[b] for bundles in plan.engine_bundles for b in bundles}
    return ranks, engines | {node_ids[plan.train_bundles[0]]}, set(node_ids)


def checks(run) -> list[tuple[str, Path, set[str], str | None]]:
    """``(option, directory, node ids, compared file)`` of every shared directory."""
    from rl_launcher.infra.checkpoints import checkpoint_dir

    config = run.config
    ranks, sync_nodes, every_node = run_nodes(run)
    found = [
        ("logging.run_dir", Path(config.logging.run_dir), every_node, None),
        ("checkpoint.dir", checkpoint_dir(config), ranks, None),
    ]
    adapters = run.sync_options.get("lora_sync") == "adapter"  # LoRA adapters go there too
    if run.sync_options.get("transport") == "disk" or adapters:
        found.append(("engine.weight_sync_dir", Path(run.sync_options["path"]), sync_nodes, None))
    if config.model.path is not None and not str(config.model.path).endswith(".gguf"):
        found.append(("model.path", Path(config.model.path), every_node, "config.json"))
    return found


def check_shared_dirs(run) -> list[tuple[str, int]]:
    """Every directory of :func:`checks` the same on its nodes and the driver's, when
    they are not all one node; ValueError naming the option and the node otherwise.
    Returns ``(option, number of nodes)`` of the directories checked."""
    import ray

    driver, checked = ray.get_runtime_context().get_node_id(), []
    for option, directory, nodes, compare in checks(run):
        if nodes - {driver}:
            check_directory(option, directory.absolute(), sorted(nodes), compare)
            checked.append((option, len(nodes)))
    return checked


def check_directory(option: str, directory: Path, node_ids: list[str], compare) -> None:
    import hashlib

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    directory.mkdir(parents=True, exist_ok=True)
    if compare is not None:
        token = hashlib.sha256((directory / compare).read_bytes()).hexdigest()
    else:
        token = uuid.uuid4().hex
        (directory / f"{PROBE_PREFIX}{token}").write_text(token)
    task = ray.remote(num_cpus=0)(probe_node)
    refs = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            str(directory), token, node, compare
        )
        for node in node_ids
    ]
    try:
        found = ray.get(refs, timeout=PROBE_TIMEOUT_S)
        for node, why in zip(node_ids, found, strict=True):
            back = directory / f"{PROBE_PREFIX}{token}-{node}"
            if why is None and compare is None and not back.is_file():
                why = f"the driver does not see the file it wrote ({back.name})"
            if why is not None:
                raise ValueError(not_shared(option, directory, node, why))
    finally:
        for probe in directory.glob(f"{PROBE_PREFIX}{token}*"):
            probe.unlink(missing_ok=True)


def not_shared(option: str, directory: Path, node_id: str, why: str) -> str:
    import ray

    address = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "?")
    return (
        f"{option}={str(directory)!r} is not the same directory on node {address} "
        f"({node_id[:12]}) as on the driver's ({why}); the run spans several nodes, so put "
        "it on storage every node mounts at the same path (NFS, Lustre, a shared volume); "
        "see docs/cluster.md"
    )
