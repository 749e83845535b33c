"""SGLang engines over several nodes (``engine.devices_per_engine`` >
``cluster.devices_per_node``), on a simulated cluster of two 1-CPU nodes
(:mod:`cluster_fixtures`) with a stand-in ``sglang.launch_server``
(``standin_sglang/``: it records its command line; node rank 0 serves SGLang's HTTP API
once the other rank has met it at ``--dist-init-addr``, the other rank serves nothing).

- One engine of 2 devices over the 2 nodes: one EngineHost actor per node of the engine
  (Ray's actor table), each the parent of the server it launched with ``--nnodes 2
  --node-rank r --dist-init-addr <node 0>:<port> --tp-size 2`` on its own node's address;
  only node rank 0's URL joins the router; generation goes through the router (a request
  for routed experts, which the router would strip, to the engine itself); a part
  that dies makes the engine dead, and a restart starts both parts again.
- Refused before Ray: an embedded engine over several nodes, and tensor weight sync to
  one; the weight-update group counts tp_size ranks for such an engine.
"""

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from test_rendezvous import listening_addresses
from test_train_loop import shrunk

ray = pytest.importorskip("ray")

from cluster_fixtures import node_address, simulated_cluster  # noqa: E402

from rl_core.routing import decode_routes  # noqa: E402
from rl_launcher.config.loader import load_config  # noqa: E402
from rl_launcher.infra.placement import plan_from_config  # noqa: E402
from rl_launcher.infra.ray_placement import create_placement  # noqa: E402
from rl_launcher.infra.weight_sync import make_sender  # noqa: E402
from rl_launcher.roles.engine_hosts import engine_sites  # noqa: E402
from rl_launcher.roles.engine_pool import EnginePool  # noqa: E402

STANDIN = Path(__file__).parent / "standin_sglang"
RECORDS_ENV = "STANDIN_SGLANG_RECORDS"
OVER_TWO_NODES = (
    "--cluster.device",
    "cuda",
    "--engine.kind",
    "sglang",
    "--cluster.num_nodes",
    "2",
    "--cluster.devices_per_node",
    "1",
    "--engine.devices_per_engine",
    "2",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two worker nodes whose raylets (so every server they start) find the stand-in."""
    records = tmp_path_factory.mktemp("sglang_argv")
    saved = {name: os.environ.get(name) for name in ("RL_SGLANG_PYTHONPATH", RECORDS_ENV)}
    os.environ.update({"RL_SGLANG_PYTHONPATH": str(STANDIN), RECORDS_ENV: str(records)})
    try:
        with simulated_cluster(num_nodes=2, cpus_per_node=1) as cluster:
            yield cluster, records
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.update({name: value})


def launched(records: Path) -> dict[int, dict]:
    """The stand-in servers started so far, by pid."""
    found = {}
    for path in records.glob("*.json"):
        entry = json.loads(path.read_text())
        found[entry["pid"]] = entry
    return found


def option(entry: dict, flag: str) -> str:
    argv = entry["argv"]
    return argv[argv.index(flag) + 1]


def engine_hosts() -> dict[int, dict]:
    """Ray's records (the GCS actor table) of the live EngineHost actors, by pid."""
    table = ray._private.state.actors(actor_state_name="ALIVE").values()
    return {a["Pid"]: a["Address"] for a in table if a["ActorClassName"] == "EngineHost"}


def generate(url: str) -> dict:
    from rl_sglang.client import EngineClient

    async def ask():
        async with EngineClient(url) as client:
            return await client.generate(input_ids=[3, 4], sampling_params={"max_new_tokens": 1})

    return asyncio.run(ask())


@pytest.mark.integration
@pytest.mark.slow
def test_an_engine_over_two_nodes_runs_a_part_on_each(cluster, tmp_path):
    cluster, records = cluster
    config, _ = load_config(
        shrunk(
            tmp_path / "run",
            *OVER_TWO_NODES,
            "--engine.weight_sync",
            "disk",
            "--cluster.ray_address",
            cluster.address,
        )
    )
    plan = plan_from_config(config)
    assert plan.engine_parts(0) == [(0,), (1,)]
    placement = create_placement(  # CPU bundles stand in for the GPUs of the plan
        plan, use_gpu=False, cpus_per_bundle=1, devices_per_node=1
    )
    pool = EnginePool(config, model_dir=tmp_path / "model", log_dir=tmp_path / "logs")
    try:
        pool.sites = engine_sites(config, plan, placement, transport="disk")
        pool.start(max_batch_size=8)
        (engine,) = pool.servers
        servers = launched(records)
        hosts = engine_hosts()
        assert len(servers) == len(hosts) == 2
        by_rank = {int(option(e, "--node-rank")): e for e in servers.values()}
        dist_init = {option(e, "--dist-init-addr") for e in servers.values()}
        assert len(dist_init) == 1 and dist_init.pop().startswith(node_address(0) + ":")
        for rank, entry in by_rank.items():
            host = hosts[entry["ppid"]]  # its parent: an EngineHost actor, not this driver
            assert host["NodeID"] == placement.node_ids[rank] == engine.node_ids[rank]
            assert option(entry, "--host") == host["IPAddress"] == node_address(rank)
            assert option(entry, "--nnodes") == "2" and option(entry, "--tp-size") == "2"
        assert engine.url == f"http://{node_address(0)}:{option(by_rank[0], '--port')}"
        assert listening_addresses(int(option(by_rank[1], "--port"))) == []  # no HTTP there
        assert pool.router.worker_urls() == pool.urls == [engine.url]  # node rank 0 only
        assert generate(pool.url)["output_ids"] == [1]  # through the router
        # routing replay: the router drops return_routed_experts; the pool's router client
        # sends such a request to the engine itself (rl_sglang.router_client)
        routed = pool.call(
            pool.client(pool.url).generate(
                input_ids=[3, 4], sampling_params={"max_new_tokens": 1}, return_routed_experts=True
            )
        )
        routes = decode_routes(routed["meta_info"]["routed_experts"], num_layers=1, top_k=1)
        assert routes.flatten().tolist() == [3, 4]  # the stand-in's experts: the token ids
        assert pool.weight_versions() == ["0"]
        # the engine is its parts: one dead part is a dead engine, a restart starts both
        os.kill(by_rank[1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while engine.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not engine.alive() and engine.process.poll() == -signal.SIGKILL
        engine.kill()
        engine.start()
        restarted = {pid: e for pid, e in launched(records).items() if pid not in servers}
        assert sorted(int(option(e, "--node-rank")) for e in restarted.values()) == [0, 1]
        assert engine.alive() and generate(engine.url)["output_ids"] == [1]
    finally:
        pool.stop()
        placement.remove()
    deadline = time.monotonic() + 30  # ray.kill returns before the GCS marks them dead
    while engine_hosts() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not engine_hosts()


def test_engines_over_nodes_refused_before_ray_unless_sglang_without_tensor_sync(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match="which the embedded engine cannot"):
        load_config(shrunk(run_dir, *OVER_TWO_NODES, "--engine.kind", "embedded"))
    tensor = re.escape("engine.weight_sync=tensor (what auto picks colocated)")
    with pytest.raises(ValueError, match=tensor):
        load_config(shrunk(run_dir, *OVER_TWO_NODES))
    config, _ = load_config(shrunk(run_dir, *OVER_TWO_NODES, "--engine.weight_sync", "disk"))
    assert config.engine.devices_per_engine == 2


def test_the_weight_update_group_counts_every_rank_of_an_engine_over_nodes():
    how = {"engine_kind": "sglang", "tp_size": 16, "group_backend": "gloo"}
    sender = make_sender(["engine 0", "engine 1"], how)  # two engines of 2 nodes x 8 GPUs
    assert sender.world_size == 1 + 2 * 16
