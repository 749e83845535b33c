"""Engines placed by Ray on their own nodes, on a simulated cluster of three 2-CPU nodes
(:mod:`cluster_fixtures`; the drivers' head node has no CPUs, so nothing of a run can land
on the driver's node).

- Colocated over 3 nodes (one training rank and one engine per node, 1-CPU bundles: the
  placement that PACK used to crowd onto one node): each engine's server is the child of an
  EngineHost actor on the node the printed layout names, listening on that node's address
  only; weights reach all three by ``tensor`` handles, each engine fed by the training rank
  on its own node (versions advance; engine log-probs equal the trainer's); metrics.jsonl
  names each engine's node and sending rank.
- Disaggregated over 2 nodes, ``rl-train`` as a subprocess with the async loop: training
  on one node, both engines on the other, weights over the gloo weight-update group.
- A cluster too small for the plan, nodes smaller than it expects, tensor weight sync to
  engines on a node without a training rank, or an API key missing for rl-train or different where training
  rank 0 runs: exit 2 with a message naming what is missing, before any actor starts.

One cluster for the module: start-ups cost tens of seconds on a shared 2-core machine.
"""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_rendezvous import listening_addresses
from test_train_loop import LOGPROB_TOL, engine_response, shrunk, trainer_log_probs

ray = pytest.importorskip("ray")

from cluster_fixtures import node_address, simulated_cluster  # noqa: E402

from rl_launcher.cli import main  # noqa: E402
from rl_launcher.config.loader import load_config  # noqa: E402
from rl_launcher.data.buffer import DataBuffer  # noqa: E402
from rl_launcher.infra.run_log import read_metrics  # noqa: E402
from rl_launcher.loops.extras import after_step  # noqa: E402
from rl_launcher.loops.rl import run_step  # noqa: E402
from rl_launcher.loops.rl_state import save  # noqa: E402
from rl_launcher.loops.step import finish_step  # noqa: E402
from rl_launcher.session.start import start_run  # noqa: E402
from rl_sglang.process import API_KEY_ENV  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NUM_NODES = 3
LAYOUT_LINE = re.compile(r"rl-train:   node (\d+) at (\S+) \((\w{12})[^)]*\): (.*)")


@pytest.fixture(scope="module")
def cluster():
    with simulated_cluster(num_nodes=NUM_NODES, cpus_per_node=2) as cluster:
        yield cluster


def on_cluster(run_dir: Path, cluster, *extra: str) -> list[str]:
    return shrunk(run_dir, "--cluster.ray_address", cluster.address, *extra)


def printed_layout(text: str) -> dict[str, tuple[str, str]]:
    """Role (``T0``, ``E1``) -> (node id prefix, address), from the start-up layout lines."""
    where = {}
    for _, address, node, cells in LAYOUT_LINE.findall(text):
        for role in re.findall(r"[TE]\d+", cells):
            where[role] = (node, address)
    return where


def actor_records(class_name: str, state: str = "ALIVE") -> list[dict]:
    """Ray's own records (the GCS actor table) of the actors of a class in ``state``."""
    table = ray._private.state.actors(actor_state_name=state)
    return [a for a in table.values() if a["ActorClassName"] == class_name]


def parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def engine_children(host_pid: int) -> list[int]:
    """Processes whose parent is ``host_pid`` and that run an embedded engine."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                if b"rl_sglang.embedded" in cmdline and parent_pid(int(entry.name)) == host_pid:
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile
                continue
    return found


def assert_started_by_hosts_on(layout: dict, engines: list) -> None:
    """Every engine: its server the child of a live EngineHost actor (Ray's record) on the
    node the layout names for it, listening on that node's address only."""
    hosts = {a["Pid"]: a["Address"] for a in actor_records("EngineHost")}
    assert len(hosts) == len(engines)
    for index, engine in enumerate(engines):
        pid = engine.process.pid
        host = hosts[parent_pid(pid)]  # the server's parent is a host actor, not this driver
        node, address = layout[f"E{index}"]
        assert host["NodeID"].startswith(node) and host["IPAddress"] == address
        assert engine.node_id == host["NodeID"] and engine.url.startswith(f"http://{address}:")
        assert listening_addresses(int(engine.url.rsplit(":", 1)[1])) == [address]


def test_colocated_over_three_nodes_engines_on_their_nodes(cluster, tmp_path, capsys):
    run_dir = tmp_path / "run"
    config, _ = load_config(
        on_cluster(
            run_dir,
            cluster,
            "--cluster.num_nodes",
            str(NUM_NODES),
            "--engine.num_engines",
            str(NUM_NODES),
        )
    )
    run = start_run(config)
    assert run.sync_options["transport"] == "tensor"  # auto, colocated: handles per node
    try:
        layout = printed_layout(capsys.readouterr().out)
        # one training rank and one engine per node, every node a different worker node
        assert {layout[f"T{i}"] for i in range(NUM_NODES)} == {
            layout[f"E{i}"] for i in range(NUM_NODES)
        } and all(layout[f"T{i}"] == layout[f"E{i}"] for i in range(NUM_NODES))
        assert sorted(a for _, a in layout.values()) == sorted(
            [node_address(i) for i in range(NUM_NODES)] * 2
        )
        assert_started_by_hosts_on(layout, run.rollout.engines.servers)
        buffer = DataBuffer.from_config(config, num_ranks=run.num_ranks)
        records = []
        for step in (1, 2):
            metrics = run_step(run, buffer, step) | after_step(run, step)
            finish_step(run, step, metrics, save)
            records.append(metrics)
            assert run.rollout.engines.weight_versions() == [str(step)] * NUM_NODES  # all three
        # each engine was fed by the training rank on its own node, and by no other
        fed = ray.get([w.engines_fed.remote() for w in run.trainer.workers])
        assert fed == [[url] for url in run.rollout.engines.urls]
        prompt_ids = run.source.datasets[0].prompts[0].tokens
        output = engine_response(run, prompt_ids, engine=NUM_NODES - 1)  # off rank 0's node
        engine_lps = [lp for lp, _, *_ in output["meta_info"]["output_token_logprobs"]]
        trainer_lps = trainer_log_probs(run, prompt_ids, output)
    finally:
        run.close()
    assert records[1]["mismatch/logprob_abs_diff_max"] < LOGPROB_TOL  # samples of version 1
    torch.testing.assert_close(torch.tensor(engine_lps), trainer_lps, atol=LOGPROB_TOL, rtol=0)
    first, second = read_metrics(run_dir)
    for index in range(NUM_NODES):
        assert first[f"engine/{index}/node"].startswith(layout[f"E{index}"][0])
        assert first[f"engine/{index}/url"].startswith(f"http://{layout[f'E{index}'][1]}:")
        assert first[f"engine/{index}/weights_from"] == index  # rank `index`, on its node
    assert not any(key.startswith("engine/") for key in second)  # once per process
    deadline = time.monotonic() + 30  # ray.kill returns before the GCS marks the actor dead
    while actor_records("EngineHost") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not actor_records("EngineHost")  # stopped with the run


def rl_train(run_dir: Path, cluster, *extra: str) -> subprocess.Popen:
    args = on_cluster(run_dir, cluster, "--logging.progress", "true", *extra)
    log = open(run_dir.parent / "rl-train.log", "ab")  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(
        [sys.executable, "-m", "rl_launcher.cli", *args], stdout=log, stderr=subprocess.STDOUT
    )


def wait_for_hosts(process: subprocess.Popen, log: Path, count: int, timeout_s=300) -> list:
    """The live EngineHost actors, once ``count`` have engines that answer."""
    deadline = time.monotonic() + timeout_s
    while "rl-train: 2 embedded engine(s) and router ready" not in log.read_text():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"engines not ready after {timeout_s}s"
        time.sleep(0.2)
    hosts = actor_records("EngineHost")
    assert len(hosts) == count
    return hosts


def test_disaggregated_async_over_two_nodes_as_rl_train(cluster, tmp_path):
    run_dir = tmp_path / "run"
    log = tmp_path / "rl-train.log"
    process = rl_train(
        run_dir,
        cluster,
        "--cluster.num_nodes",
        "2",
        "--cluster.devices_per_node",
        "2",
        "--cluster.colocate",
        "false",
        "--engine.num_engines",
        "2",
        "--rollout.loop",
        "async",
        "--checkpoint.interval",
        "0",
        "--num_steps",
        "6",
    )
    try:
        hosts = wait_for_hosts(process, log, count=2)
        layout = printed_layout(log.read_text())
        for host in hosts:  # each host's one engine server runs under it, on its node
            (pid,) = engine_children(host["Pid"])
            assert parent_pid(pid) == host["Pid"] != process.pid
        assert {h["Address"]["NodeID"][:12] for h in hosts} == {layout["E0"][0]}
        assert layout["T0"] == layout["T1"] != layout["E0"] == layout["E1"]
        assert process.wait(600) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    records = read_metrics(run_dir)  # each sync checked every engine's version (rl_state.sync)
    assert [r["sync/weight_version"] for r in records] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    node, address = layout["E0"]
    assert records[0]["engine/0/node"].startswith(node)
    assert records[0]["engine/1/url"].startswith(f"http://{address}:")


def run_actors() -> int:
    """How many training and engine actors Ray has ever recorded (alive or not)."""
    table = ray._private.state.actors().values()
    return sum(a["ActorClassName"] in ("TrainWorker", "EngineHost") for a in table)


def refused(capsys, run_dir: Path, cluster, *extra: str) -> str:
    """rl-train's one-line error for a layout the cluster cannot hold (exit 2), given
    before any training rank or engine started."""
    before = run_actors()
    code = main(on_cluster(run_dir, cluster, *extra))
    error = capsys.readouterr().err
    assert code == 2, error
    assert run_actors() == before
    return error


def test_clusters_that_cannot_hold_the_plan_are_refused_naming_the_nodes(cluster, tmp_path, capsys):
    workers = ", ".join(f"{node_address(i)} (CPU 2)" for i in range(NUM_NODES))
    head = f"{cluster.head_node.node_ip_address} (no CPU)"
    error = refused(capsys, tmp_path / "a", cluster, "--cluster.num_nodes", "4")
    assert "needs 4 node(s) with CPU 1 each" in error, error
    assert f"has 3: {workers}; too small: {head}. Add nodes" in error, error
    error = refused(capsys, tmp_path / "b", cluster, "--cluster.devices_per_node", "3")
    assert "needs 1 node(s) with CPU 3 each" in error, error
    assert f"has 0; too small: {head}, {workers}. Add nodes" in error, error
    # tensor handles cannot reach engines on a node without a training rank
    two = ("--cluster.num_nodes", "2", "--cluster.colocate", "false")
    error = refused(capsys, tmp_path / "c", cluster, *two, "--engine.weight_sync", "tensor")
    assert "engine.weight_sync=tensor" in error and "engines [0] are on nodes without" in error


def test_engines_off_the_drivers_node_need_the_same_key_everywhere(
    cluster, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv(API_KEY_ENV)  # rl-train without a key; the nodes have one
    error = refused(capsys, tmp_path / "a", cluster)
    assert f"set {API_KEY_ENV} to one secret in the environment of rl-train" in error, error
    monkeypatch.setenv(API_KEY_ENV, "another key")  # training rank 0 could not reach them
    error = refused(capsys, tmp_path / "b", cluster)
    assert f"node {node_address(0)} has another {API_KEY_ENV} than rl-train" in error, error
