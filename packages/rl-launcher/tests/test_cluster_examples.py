"""examples/cluster: the configs load and lay out as their comments say, and the KubeRay
manifest and Slurm script start the cluster those configs need (nodes, GPUs, CPUs for the
bundles, the API key and the shared volume on every node)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rl_launcher.config.loader import load_config
from rl_launcher.infra.placement import plan_from_config
from rl_launcher.infra.weight_sync import engine_senders, resolve_transport

ROOT = Path(__file__).resolve().parents[3]
CLUSTER = ROOT / "examples" / "cluster"


def config_of(name: str):
    return load_config(["--config", str(CLUSTER / name)])[0]


def nodes_of(plan, bundles) -> list[int]:
    return [plan.slots[b].node for b in bundles]


def test_colocated_config_shares_both_nodes():
    config = config_of("colocated_2x8.yaml")
    plan = plan_from_config(config)
    assert plan.num_bundles == 16 and plan.num_train_ranks == 16
    assert nodes_of(plan, plan.train_bundles) == [0] * 8 + [1] * 8
    assert [nodes_of(plan, e) for e in plan.engine_bundles] == [[0, 0]] * 4 + [[1, 1]] * 4
    transport = resolve_transport(config.engine.weight_sync, colocate=True, device="cuda")
    assert transport == "tensor"  # handles from a rank on each engine's own node
    engine_nodes = [nodes_of(plan, e)[0] for e in plan.engine_bundles]
    senders = engine_senders(engine_nodes, nodes_of(plan, plan.train_bundles), transport)
    assert senders == [0] * 4 + [8] * 4  # the lowest rank of each node
    assert config.logging.run_dir.startswith("/shared/")


def test_disaggregated_config_trains_on_one_node_and_serves_on_the_other():
    config = config_of("disaggregated_2x8.yaml")
    plan = plan_from_config(config)
    assert nodes_of(plan, plan.train_bundles) == [0] * 8
    assert [nodes_of(plan, e) for e in plan.engine_bundles] == [[1, 1]] * 4
    transport = resolve_transport(config.engine.weight_sync, colocate=False, device="cuda")
    assert transport == "distributed"


def test_rayjob_starts_the_cluster_its_config_needs():
    job = yaml.safe_load((CLUSTER / "kuberay" / "rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    command = job["spec"]["entrypoint"].split()
    assert command[:2] == ["rl-train", "--config"]
    config = load_config(["--config", str(ROOT / command[2])])[0]
    spec = job["spec"]["rayClusterSpec"]
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no bundle on the drivers' node
    (workers,) = spec["workerGroupSpecs"]
    assert workers["replicas"] == config.cluster.num_nodes
    pods = [head["template"]["spec"], workers["template"]["spec"]]
    (worker,) = workers["template"]["spec"]["containers"]
    limits = worker["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == config.cluster.devices_per_node
    assert float(limits["cpu"]) >= config.cluster.devices_per_node * config.cluster.cpus_per_bundle
    for pod in pods:
        (container,) = pod["containers"]
        assert "RL_SGLANG_API_KEY" in {e["name"] for e in container["env"]}
        shared = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["shared"]
        assert config.logging.run_dir.startswith(shared + "/")
        assert config.model.path.startswith(shared + "/")


def test_slurm_script_parses_and_asks_for_the_config_layout():
    if shutil.which("bash") is None:
        pytest.skip("no bash here")
    script = (CLUSTER / "slurm" / "rl_train.sbatch").read_text()
    subprocess.run(["bash", "-n", str(CLUSTER / "slurm" / "rl_train.sbatch")], check=True)
    default = re.search(r"CONFIG=\$\{CONFIG:-(\S+)\}", script).group(1)
    config = load_config(["--config", str(ROOT / default)])[0]
    asked = dict(re.findall(r"#SBATCH --([\w-]+)=(\S+)", script))
    assert int(asked["nodes"]) == config.cluster.num_nodes
    assert int(asked["gpus-per-node"]) == config.cluster.devices_per_node
    bundles_per_node = config.cluster.devices_per_node * config.cluster.cpus_per_bundle
    assert int(asked["cpus-per-task"]) >= bundles_per_node
    assert 'export RAY_ADDRESS="$head_ip:$RAY_PORT"' in script  # the wait for the nodes
    # rl-train submitted as a Ray job to the head's dashboard (its entrypoint gets RAY_ADDRESS)
    assert "--dashboard-port=$DASHBOARD_PORT" in script.split("ray start --address")[0]
    submit = re.search(r'ray job submit --address "(\S+)" \\\n\s+(.*)', script)
    assert submit.group(1) == "http://127.0.0.1:$DASHBOARD_PORT"
    assert submit.group(2) == '--working-dir . -- rl-train --config "$CONFIG" "$@"'
    assert "export RL_SGLANG_API_KEY=" in script.split("srun")[0]  # before any raylet
