"""A simulated multi-node Ray cluster on this machine, for tests of runs over several nodes.

    @pytest.fixture(scope="module")
    def cluster():
        with simulated_cluster(num_nodes=3, cpus_per_node=2) as cluster:
            yield cluster          # this process is attached: ray.* talks to it
    ... start_run(config with --cluster.ray_address cluster.address) ...

``ray.cluster_utils.Cluster``: a head node without CPUs (the drivers' node: no bundle can
land there) and ``num_nodes`` worker nodes, each its own raylet with ``cpus_per_node``
CPUs, at its own loopback address (127.0.0.2, 127.0.0.3, ...), so an address on a worker
node differs from the driver's as it would between real machines. Engines on those
addresses need the API key: :data:`API_KEY` is set in ``RL_SGLANG_API_KEY`` of this
process before the nodes start, so the raylets, their workers and any ``rl-train`` started
from here hold it, as every node of a real cluster must. Start-ups cost tens of seconds on
a loaded 2-core machine: share one cluster per module.

The head checks its nodes' health every second (Ray's default is every 3 s; a node is dead
after 5 failed checks in a row), so a test that removes a node waits about 5 s, not 15, for
Ray to report it dead. A check still gives a busy node Ray's default 10 s to answer.
"""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import ray
from ray.cluster_utils import Cluster

from rl_sglang.process import API_KEY_ENV

API_KEY = "simulated-cluster-key"


def node_address(index: int) -> str:
    """Worker node ``index``'s address (0-based): 127.0.0.2, 127.0.0.3, ..."""
    return f"127.0.0.{index + 2}"


@contextlib.contextmanager
def simulated_cluster(num_nodes: int, cpus_per_node: float = 2) -> Iterator[Cluster]:
    """A head (no CPUs) and ``num_nodes`` worker nodes; this process attached to it."""
    temp_dir = tempfile.mkdtemp(prefix="rlc", dir="/tmp")  # short: Ray's socket paths
    previous_key = os.environ.get(API_KEY_ENV)
    os.environ[API_KEY_ENV] = API_KEY  # before any raylet starts: they all inherit it
    head = {"num_cpus": 0, "temp_dir": temp_dir, "_system_config": {"health_check_period_ms": 1000}}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        _forget_default_address(cluster)
        for index in range(num_nodes):
            cluster.add_node(
                num_cpus=cpus_per_node, node_ip_address=node_address(index), temp_dir=temp_dir
            )
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if previous_key is None:
            os.environ.pop(API_KEY_ENV, None)
        else:
            os.environ[API_KEY_ENV] = previous_key


def _forget_default_address(cluster: Cluster) -> None:
    """``Cluster`` writes its address to /tmp/ray/ray_current_cluster, where every plain
    ``ray.init()`` on this machine (other test runs starting a local Ray) would then find
    and join it; tests here always pass the address, so the file is taken back."""
    from ray._common.utils import get_ray_address_file

    path = get_ray_address_file(None)
    with contextlib.suppress(FileNotFoundError):
        with open(path) as file:
            written = file.read().strip()
        if written == cluster.gcs_address:
            os.remove(path)


def worker_node_ids(cluster: Cluster) -> dict[str, str]:
    """Ray node id -> address of each worker node still in ``cluster``."""
    return {node.node_id: node.node_ip_address for node in cluster.worker_nodes}
