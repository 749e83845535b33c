"""Runs on a simulated two-node Ray cluster (:mod:`cluster_fixtures`: a head node for the
drivers and two worker nodes, each its own raylet with one CPU bundle's worth, at their
own loopback addresses 127.0.0.2 / 127.0.0.3, so a rank's node address differs from the
driver's as it would on real machines).

- The training group, the critic group and the weight-update group meet at training rank
  0's node address, read from Ray's own state, on ports that listen there only.
- ``rl-train`` attached through ``RAY_ADDRESS`` (as ``ray job submit`` runs it) loses a
  node mid-run: it exits 1 naming the node and the last complete checkpoint; ``--resume``
  on the cluster made whole again trains on the same prompts, step by step, as an
  uninterrupted run.

One cluster for the module (start-ups cost seconds each on a shared 2-core machine).
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
from cluster_fixtures import node_address, simulated_cluster
from test_kill_resume import uninterrupted_order, wait_for
from test_rendezvous import listening_addresses
from test_train_loop import shrunk

from rl_launcher.config.loader import load_config
from rl_launcher.infra import checkpoints, data_order
from rl_launcher.infra.run_log import read_metrics
from rl_launcher.infra.shared_dirs import check_shared_dirs
from rl_launcher.loops.rl import run_step
from rl_launcher.loops.rl_state import sync
from rl_launcher.roles.critic import make_buffer
from rl_launcher.session.start import start_run

pytestmark = pytest.mark.integration
NODE_ADDRESSES = (node_address(0), node_address(1))  # 127.0.0.2, 127.0.0.3
NUM_STEPS = 8


@pytest.fixture(scope="module")
def cluster():
    """Two worker nodes of one CPU each (one bundle each: the ranks must spread)."""
    with simulated_cluster(num_nodes=2, cpus_per_node=1) as cluster:
        yield cluster


def on_two_nodes(run_dir: Path, cluster, *extra: str) -> list[str]:
    """The shrunk quickstart, one training rank per worker node, attached to ``cluster``."""
    return shrunk(
        run_dir,
        "--cluster.num_nodes",
        "2",
        "--cluster.devices_per_node",
        "1",
        "--cluster.ray_address",
        cluster.address,
        *extra,
    )


def alive_actors(class_name: str) -> list[dict]:
    """Ray's own records (the GCS actor table) of the live actors of a class."""
    table = ray._private.state.actors(actor_state_name="ALIVE")  # no dashboard needed
    return [a for a in table.values() if a["ActorClassName"] == class_name]


def node_of(actor) -> tuple[str, str]:
    """``(node id, node address)`` of a live actor, from Ray's actor table."""
    record = ray._private.state.actors(actor_id=actor._actor_id.hex())
    return record["Address"]["NodeID"], record["Address"]["IPAddress"]


def test_groups_meet_at_training_rank_0s_node(cluster, tmp_path):
    # PPO (a critic group beside the trainer) with the distributed weight-update group
    config, _ = load_config(
        on_two_nodes(
            tmp_path / "run",
            cluster,
            "--algorithm.advantage_estimator",
            "gae",
            "--engine.weight_sync",
            "distributed",
        )
    )
    run = start_run(config)
    try:
        (node0, address0), (node1, address1) = map(node_of, run.trainer.workers)
        assert node0 != node1 and {address0, address1} == set(NODE_ADDRESSES)
        assert address0 != ray.util.get_node_ip_address()  # not the driver's address
        for host, port in (run.trainer.address, run.critic.address):
            assert host == address0
            assert listening_addresses(port) == [address0]  # not every interface
        assert [node_of(w)[0] for w in run.critic.workers] == [node0, node1]
        # the directories the nodes share, probed from both (as at start-up)
        assert check_shared_dirs(run) == [("logging.run_dir", 2), ("checkpoint.dir", 2)]
        assert not list((tmp_path / "run").glob(".shared-probe-*"))  # probes cleaned up
        sync(run, version=1)  # the weight-update group: rank 0 with the engine
        host, port = ray.get(run.trainer.workers[0].weight_sync_address.remote())
        assert host == address0 and listening_addresses(port) == [address0]
        assert run.rollout.engines.weight_versions() == ["1"]
        buffer = make_buffer(run)  # with the critic's values
        metrics = run_step(run, buffer, step=2)  # both ranks and both critics train
        assert metrics["train/num_samples"] == 16 and "loss/value" in metrics
        assert run.rollout.engines.weight_versions() == ["2"]
    finally:
        run.close()


CONNECT = (
    "import ray; from rl_launcher.infra.ray_cluster import connect; "
    "print(connect(num_cpus=1), len(ray.nodes()))"
)


def test_a_run_attaches_only_to_the_cluster_it_is_given(cluster):
    # `ray start` on a machine leaves its cluster's address in <RAY_TMPDIR>/ray/
    # ray_current_cluster, where a bare ray.init() finds and joins it (then refuses num_cpus)
    temp_dir = Path(tempfile.mkdtemp(prefix="rlc", dir="/tmp"))  # short: Ray's socket paths
    try:
        (temp_dir / "ray").mkdir()
        (temp_dir / "ray" / "ray_current_cluster").write_text(cluster.address)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["RAY_TMPDIR"] = str(temp_dir)
        for address, expected in ((None, ["started", "1"]), (cluster.address, ["attached", "3"])):
            run_env = env if address is None else {**env, "RAY_ADDRESS": address}
            done = subprocess.run(
                [sys.executable, "-c", CONNECT],
                env=run_env,
                text=True,
                capture_output=True,
                timeout=300,
            )
            assert done.stdout.split() == expected, done.stderr[-3000:]
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def rl_train(run_dir: Path, cluster, *extra: str) -> subprocess.Popen:
    """``rl-train`` as a Ray job runs it: attached through RAY_ADDRESS, no option."""
    args = shrunk(
        run_dir,
        "--cluster.num_nodes",
        "2",
        "--cluster.devices_per_node",
        "1",
        "--num_steps",
        str(NUM_STEPS),
        "--logging.progress",
        "true",
        *extra,
    )
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    log = open(run_dir.parent / f"{run_dir.name}.log", "ab")  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(
        [sys.executable, "-m", "rl_launcher.cli", *args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def log_of(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}.log").read_text(errors="replace")


def test_a_lost_node_stops_the_run_naming_it_and_resume_continues(cluster, tmp_path):
    run_dir = tmp_path / "run"
    process = rl_train(run_dir, cluster)
    wait_for(run_dir / "checkpoints" / "step_000002" / "state.json", process)
    workers = alive_actors("TrainWorker")  # this run's ranks, on the cluster's worker nodes
    assert sorted(w["Address"]["IPAddress"] for w in workers) == list(NODE_ADDRESSES)
    # each rank wrote its own shard of the checkpoint, from its node, into the shared dir
    shards = run_dir / "checkpoints" / "step_000002" / "trainer" / "dcp"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    lost = next(n for n in cluster.worker_nodes if n.node_id == workers[1]["Address"]["NodeID"])
    cluster.remove_node(lost, allow_graceful=False)  # its raylet and workers killed
    removed = time.monotonic()
    code = process.wait(180)
    print(f"rl-train exited {time.monotonic() - removed:.0f} s after the node was removed")
    log = log_of(run_dir)
    assert code == 1, log[-3000:]
    done = checkpoints.complete_checkpoints(
        checkpoints.checkpoint_dir(load_config(on_two_nodes(run_dir, cluster))[0])
    )
    stopped = next(
        (line for line in log.splitlines() if line.startswith("rl-train: stopped:")), None
    )
    assert stopped is not None, log[-3000:]
    assert f", on node {lost.node_ip_address} ({lost.node_id[:12]}), which Ray reports dead" in (
        stopped
    ), stopped
    assert f"last complete checkpoint: {done[-1][1]} (step {done[-1][0]})" in stopped, stopped
    cluster.add_node(num_cpus=1, node_ip_address=lost.node_ip_address)  # a healthy cluster
    cluster.wait_for_nodes()
    started = time.monotonic()
    resumed = rl_train(run_dir, cluster, "--resume")
    assert resumed.wait(300) == 0, log_of(run_dir)[-3000:]
    print(f"resumed run: {time.monotonic() - started:.0f} s")
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, NUM_STEPS + 1))
    assert data_order.read(run_dir) == uninterrupted_order(
        on_two_nodes(run_dir, cluster), NUM_STEPS
    )
