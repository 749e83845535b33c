"""How the control plane grows with the number of GPUs (issue 33): the launcher's real
start-up, Ray placement, sglang-router, rollout, buffer, loop, weight-sync orchestration
and checkpoints, driven with stand-in engines and training ranks whose compute is modeled
(:mod:`rl_launcher.simulated`), on a simulated cluster of 8-GPU nodes (one raylet each,
``ray.cluster_utils.Cluster``; a "GPU" is one bundle of one CPU).

    nice -n 19 python bench/scale_sim.py --gpus 8,16,32 --layouts colocated,disaggregated \
        --loops sync,async --steps 4 --out runs/scale_sim.json

Per size, layout and loop: start-up (placement, trainer, engines and router), then per
step the loop's own wall times (``time/rollout``, ``time/train``, ``time/sync``,
``time/train_dispatch`` ...), the driver's CPU seconds in each part of the step (and in
the per-token advantages, ``driver_cpu/advantages``: its thread's CPU), the buffer's time (groups in, advantages and per-rank batches out), the bytes handed to Ray
(the per-rank batches), the router's added latency (median of sequential
``max_new_tokens=0`` requests through the router minus straight to one engine), the
checkpoint's wall time, and the driver's and router's memory. Prints one JSON line per
run and writes them all to ``--out``.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples/quickstart"
GPUS_PER_NODE = 8
API_KEY = "scale-sim-key"


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def simulated_cluster(num_nodes: int):
    """A head without CPUs (the driver's node) and ``num_nodes`` 8-"GPU" nodes at their own
    loopback addresses, as packages/rl-launcher/tests/cluster_fixtures.py makes them."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="rls", dir="/tmp")
    previous_key = os.environ.get("RL_SGLANG_API_KEY")
    os.environ["RL_SGLANG_API_KEY"] = API_KEY  # before the raylets: every node holds it
    cluster = started_head(temp_dir)
    try:
        forget_default_address(cluster)
        for index in range(num_nodes):
            cluster.add_node(
                num_cpus=GPUS_PER_NODE,
                node_ip_address=f"127.0.0.{index + 2}",
                temp_dir=temp_dir,
            )
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if previous_key is None:  # the process's environment as it was
            os.environ.pop("RL_SGLANG_API_KEY", None)
        else:
            os.environ["RL_SGLANG_API_KEY"] = previous_key


def started_head(temp_dir: str, attempts: int = 3):
    """The cluster's head (no CPUs), tried ``attempts`` times: Ray gives a raylet 30 s to
    register, which a loaded 2-core machine (load average 60) sometimes misses."""
    from ray.cluster_utils import Cluster

    for attempt in range(1, attempts + 1):
        try:
            return Cluster(
                initialize_head=True, head_node_args={"num_cpus": 0, "temp_dir": temp_dir}
            )
        except Exception as error:  # "timed out during startup": try again, then give up
            if attempt == attempts:
                raise
            print(f"scale_sim: head start {attempt} failed ({error}); again", file=sys.stderr)
    raise AssertionError("unreachable")


def forget_default_address(cluster) -> None:
    """``Cluster`` writes its address where a plain ``ray.init()`` elsewhere on this machine
    would find and join it; take it back (this bench always passes the address)."""
    from ray._common.utils import get_ray_address_file

    path = get_ray_address_file(None)
    with contextlib.suppress(FileNotFoundError):
        with open(path) as file:
            written = file.read().strip()
        if written == cluster.gcs_address:
            os.remove(path)


def write_prompts(path: Path, num_prompts: int) -> Path:
    """``num_prompts`` additions in the quickstart's format (its 25, repeated)."""
    rows = (QUICKSTART / "data/train.jsonl").read_text().splitlines()
    path.write_text("\n".join(rows[i % len(rows)] for i in range(num_prompts)) + "\n")
    return path


def sim_config(args, *, gpus: int, layout: str, loop: str, run_dir: Path, address: str, plane: str):
    """The quickstart config laid out over ``gpus`` simulated GPUs."""
    from rl_launcher.config.loader import load_config

    colocate = layout == "colocated"
    engine_gpus = gpus if colocate else gpus // 2
    prompts = gpus * args.prompts_per_gpu
    data = write_prompts(run_dir.parent / f"prompts_{prompts}.jsonl", prompts * (args.steps + 2))
    argv = [
        "--config", str(QUICKSTART / "config.yaml"),
        "--num_steps", str(args.steps),
        "--logging.run_dir", str(run_dir),
        "--logging.progress", "false",
        "--model.tokenizer_path", str(QUICKSTART / "tokenizer"),
        "--model.init_config.max_position_embeddings", str(16 + args.max_response_tokens),
        "--data.train.0.path", str(data),
        "--rollout.batch_size", str(prompts),
        "--rollout.group_size", str(args.group_size),
        "--rollout.max_response_tokens", str(args.max_response_tokens),
        "--rollout.loop", loop,
        "--algorithm.num_minibatches", "1",
        "--checkpoint.interval", "1",
        "--checkpoint.keep_last", "1",
        "--cluster.ray_address", address,
        "--cluster.num_nodes", str(gpus // GPUS_PER_NODE),
        "--cluster.devices_per_node", str(GPUS_PER_NODE),
        "--cluster.colocate", str(colocate).lower(),
        "--engine.num_engines", str(engine_gpus // args.engine_tp),
        "--engine.devices_per_engine", str(args.engine_tp),
        "--engine.weight_sync", "distributed",  # tensor handles stay on rank 0's node
        "--engine.health_interval_s", "0",
        "--engine.weight_bucket_bytes", str(args.bucket_mb << 20),
        "--rollout.data_plane", plane,
    ]  # fmt: skip
    if not colocate:
        argv += ["--backend.num_ranks", str(gpus - engine_gpus)]
    config, _ = load_config(argv)
    return config


class Probe:
    """What the loop does not record itself, per step (see the module docstring)."""

    def __init__(self):
        self.steps: list[dict] = []
        self.current: dict = {}
        self.startup: dict = {}
        self.run = None

    def add(self, key: str, value: float) -> None:
        self.current[key] = self.current.get(key, 0.0) + value


def timed(probe: Probe, key: str, fn, *, store=None):
    """``fn`` whose wall time adds to ``probe.current[key]`` (or ``store[key]``)."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            if store is None:
                probe.add(key, seconds)
            else:
                store[key] = store.get(key, 0.0) + seconds

    return wrapper


def thread_cpu_timed(probe: Probe, key: str, fn):
    """``fn`` whose CPU seconds on the calling thread add to ``probe.current[key]``."""

    def wrapper(*args, **kwargs):
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            probe.add(key, time.thread_time() - start)

    return wrapper


def cpu_clock(probe: Probe, base):
    """The loop's Clock, also taking the driver's CPU seconds of each lap."""

    class CpuClock(base):
        def __init__(self):
            super().__init__()
            self.cpu = time.process_time()

        def lap(self, part: str) -> None:
            super().lap(part)
            now = time.process_time()
            probe.add(f"driver_cpu/{part}", now - self.cpu)
            self.cpu = now

    return CpuClock


async def _median_latency(url: str, num: int) -> float:
    from rl_sglang.client import EngineClient

    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}}
    async with EngineClient(url) as client:
        seconds = []
        for _ in range(num):
            start = time.perf_counter()
            await client.generate(**body)
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def router_latency(run, num: int = 20) -> float:
    """Median seconds the router adds to a request (through it minus straight to engine 0)."""
    pool = run.rollout.engines
    before = pool.call(_median_latency(pool.urls[0], num))  # straight to engine 0, warm
    through = pool.call(_median_latency(pool.url, num))
    after = pool.call(_median_latency(pool.urls[0], num))
    return through - (before + after) / 2


def actor_memory(run) -> dict:
    """Resident memory of the stand-ins' actors (one per node for ranks, one per node for
    engines): the largest and the sum."""
    import ray

    hosts = list({id(e.actor): e.actor for e in run.rollout.engines.servers}.values())
    engines = ray.get([h.rss_bytes.remote() for h in hosts])
    ranks = run.trainer.rss_bytes()
    return {
        "rss/rank_node_actor_max": max(ranks),
        "rss/rank_node_actors_sum": sum(ranks),
        "rss/engine_node_actor_max": max(engines),
        "rss/engine_node_actors_sum": sum(engines),
    }


def instrumented(probe: Probe, stack: contextlib.ExitStack) -> None:
    """Timing wrappers around the launcher's own functions (nothing else changes)."""
    from rl_launcher.data import buffer as buffer_module
    from rl_launcher.infra import ray_placement
    from rl_launcher.loops import rl
    from rl_launcher.roles import engine_pool, rollout_workers

    start_run, run_step, save = rl.start_run, rl.run_step, rl.save
    store = probe.startup

    def start_run_timed(config):
        start = time.perf_counter()
        probe.run = start_run(config)
        store["time/start_run"] = time.perf_counter() - start
        store.update(actor_memory(probe.run))
        return probe.run

    def run_step_timed(run, buffer, step, feed=None):
        probe.current = {}
        cpu, router_cpu, start = (
            time.process_time(),
            cpu_of(run.rollout.engines.router.process.pid),
            time.perf_counter(),
        )
        metrics = run_step(run, buffer, step, feed)
        probe.add("driver_cpu/step", time.process_time() - cpu)
        probe.add("router_cpu/step", cpu_of(run.rollout.engines.router.process.pid) - router_cpu)
        probe.add("wall/step", time.perf_counter() - start)
        probe.add("ray/batch_bytes", run.trainer.take_sent_bytes())
        probe.current["router/added_latency_s"] = router_latency(run)
        probe.current["driver/rss_bytes"] = rss_of(os.getpid())
        probe.current["router/rss_bytes"] = rss_of(run.rollout.engines.router.process.pid)
        probe.steps.append({"step": step, **probe.current, **metrics})
        return metrics

    def save_timed(run, step):
        start = time.perf_counter()
        save(run, step)
        probe.steps[-1]["time/checkpoint"] = time.perf_counter() - start

    pool_start = engine_pool.EnginePool.start
    stack.enter_context(mock.patch.object(rl, "start_run", start_run_timed))
    stack.enter_context(mock.patch.object(rl, "run_step", run_step_timed))
    stack.enter_context(mock.patch.object(rl, "save", save_timed))
    no_charts = Future()
    no_charts.set_result(None)
    stack.enter_context(mock.patch.object(rl, "draw_charts_meanwhile", lambda run_dir: no_charts))
    stack.enter_context(mock.patch.object(rl, "Clock", cpu_clock(probe, rl.Clock)))
    for cls in (buffer_module.DataBuffer, rollout_workers.RowsBuffer):  # data_plane: either
        for name in ("add_groups", "pop_step"):
            if name in vars(cls):
                method = getattr(cls, name)
                stack.enter_context(
                    mock.patch.object(cls, name, timed(probe, f"buffer/{name}", method))
                )
    advantages = (  # the per-token advantages, on the driver on either data plane
        (buffer_module.DataBuffer, "advantages"),
        (rollout_workers.RowsBuffer, "packed_advantages"),
    )
    for cls, name in advantages:
        method = getattr(cls, name)
        stack.enter_context(
            mock.patch.object(cls, name, thread_cpu_timed(probe, "driver_cpu/advantages", method))
        )
    placement = ray_placement.create_placement
    stack.enter_context(
        mock.patch.object(
            ray_placement,
            "create_placement",
            timed(probe, "time/placement", placement, store=store),
        )
    )
    stack.enter_context(
        mock.patch.object(
            engine_pool.EnginePool,
            "start",
            timed(probe, "time/engines_and_router", pool_start, store=store),
        )
    )


def run_one(
    args, *, gpus: int, layout: str, loop: str, address: str, work: Path, plane: str = "driver"
) -> dict:
    from rl_launcher.loops.rl import train
    from rl_launcher.simulated import SimModel, simulated_roles

    run_dir = work / f"g{gpus}_{layout}_{loop}_{plane}"
    config = sim_config(
        args, gpus=gpus, layout=layout, loop=loop, run_dir=run_dir, address=address, plane=plane
    )
    model = SimModel(
        tokens_per_s=args.tokens_per_s,
        weight_bytes=int(args.weight_gb * 1e9),
        train_s=args.train_s,
    )
    probe = Probe()
    with contextlib.ExitStack() as stack:
        stack.enter_context(simulated_roles(model))
        instrumented(probe, stack)
        start = time.perf_counter()
        train(config)
        total = time.perf_counter() - start
    return {
        "gpus": gpus,
        "nodes": gpus // GPUS_PER_NODE,
        "layout": layout,
        "loop": loop,
        "data_plane": plane,
        "num_engines": config.engine.num_engines,
        "num_train_ranks": gpus
        if layout == "colocated"
        else gpus - config.engine.num_engines * args.engine_tp,
        "samples_per_step": config.rollout.batch_size * config.rollout.group_size,
        "model": model.__dict__,
        "startup": probe.startup,
        "total_s": total,
        "steps": probe.steps,
    }


def hardware() -> dict:
    load = os.getloadavg()
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": round(load[0], 2),
        "python": sys.version.split()[0],
        "date": datetime.date.today().isoformat(),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", default="8,16,32")
    parser.add_argument("--layouts", default="colocated,disaggregated")
    parser.add_argument("--loops", default="sync,async")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts-per-gpu", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-response-tokens", type=int, default=256)
    parser.add_argument("--engine-tp", type=int, default=1)
    parser.add_argument("--tokens-per-s", type=float, default=2000.0)
    parser.add_argument("--weight-gb", type=float, default=1.0)
    parser.add_argument("--train-s", type=float, default=0.2)
    parser.add_argument("--bucket-mb", type=int, default=1024, help="weight-sync bucket size")
    parser.add_argument(
        "--data-planes",
        default="driver",
        help="rollout.data_plane values to run at each size, layout and loop (driver,workers)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="scale_sim_"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for gpus in [int(g) for g in args.gpus.split(",")]:
        assert gpus % GPUS_PER_NODE == 0, f"--gpus {gpus}: a multiple of {GPUS_PER_NODE}"
        start = time.perf_counter()
        with simulated_cluster(gpus // GPUS_PER_NODE) as cluster:
            cluster_s = time.perf_counter() - start
            runs = [
                (layout, loop, plane)
                for layout in args.layouts.split(",")
                for loop in args.loops.split(",")
                for plane in args.data_planes.split(",")
            ]
            for layout, loop, plane in runs:
                try:
                    result = run_one(
                        args,
                        gpus=gpus,
                        layout=layout,
                        loop=loop,
                        address=cluster.address,
                        work=work,
                        plane=plane,
                    )
                except Exception as error:  # the other runs still go; the error is kept
                    print(f"scale_sim: {gpus} {layout} {loop} {plane}: {error!r}", file=sys.stderr)
                    results.append(
                        {
                            "gpus": gpus,
                            "layout": layout,
                            "loop": loop,
                            "data_plane": plane,
                            "error": repr(error),
                        }
                    )
                    continue
                result |= {
                    "cluster_start_s": cluster_s,
                    "hardware": hardware(),
                    "command": " ".join(sys.argv),
                }
                print(json.dumps(summary(result)), flush=True)
                results.append(result)
                if args.out is not None:
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(results, indent=1))
    return results


def summary(result: dict) -> dict:
    """One line per run: medians over the steps after the first (warm-up)."""
    steps = result["steps"][1:] or result["steps"]
    keys = sorted({k for s in steps for k in s if isinstance(s.get(k), (int, float))})
    wanted = [
        k
        for k in keys
        if k.split("/")[0]
        in ("time", "driver_cpu", "router_cpu", "buffer", "ray", "router", "driver", "wall", "rows")
    ]
    medians = {k: statistics.median(s[k] for s in steps if k in s) for k in wanted}
    head = {
        k: result[k]
        for k in (
            "gpus",
            "layout",
            "loop",
            "data_plane",
            "num_engines",
            "num_train_ranks",
            "samples_per_step",
        )
    }
    return head | {"startup": result["startup"], "median": medians}


if __name__ == "__main__":
    main()
