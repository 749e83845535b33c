"""algorithm.routing_replay (R3): refused before Ray starts where it cannot work, the engines
(embedded or SGLang) started and the rollouts asking for routes where it can; and, at
bench/routing_replay.py's smallest size (a bf16 embedded engine, the fp32 FSDP backend, a
small Qwen3-MoE), replaying the engine's routes closes most of the trainer/engine log-prob
gap that routing alone opens."""

import importlib.util
from pathlib import Path

import pytest

from rl_launcher.config.loader import load_config
from rl_launcher.config.routing_checks import routed_experts_shape
from rl_launcher.roles.engine_servers import engine_process, sglang_server_args

MOE = (
    "model.init_config={model_type: qwen3_moe, hidden_size: 64, intermediate_size: 128, "
    "moe_intermediate_size: 32, num_hidden_layers: 2, num_attention_heads: 4, "
    "num_key_value_heads: 2, head_dim: 16, vocab_size: 512, num_experts: 4, "
    "num_experts_per_tok: 2, max_position_embeddings: 512}"
)
BENCH = Path(__file__).resolve().parents[3] / "bench" / "routing_replay.py"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["algorithm.routing_replay=true"], r"model_type 'qwen2'\) is dense"),
        (
            [MOE, "algorithm.routing_replay=true", "rollout.source=buffer"],
            r"rollout\.source=buffer",
        ),
        (
            [MOE, "algorithm.routing_replay=true", "rollout.data_plane=workers"],
            r"data_plane=workers generates without",
        ),
        (
            [
                MOE,
                "algorithm.routing_replay=true",
                "backend.name=megatron",
                "backend.pipeline_parallel=2",
                "backend.num_ranks=2",
                "cluster.devices_per_node=2",
                "model.gradient_checkpointing=true",
            ],
            r"pipeline parallelism and activation recompute",
        ),
    ],
)
def test_routing_replay_is_refused_where_it_cannot_work(args, message):
    with pytest.raises(ValueError, match=message):
        load_config(args)


def test_engines_start_for_routes_and_rollouts_ask_for_them(tmp_path):
    config, _ = load_config([MOE, "algorithm.routing_replay=true"])
    assert routed_experts_shape(config) == (2, 2)
    # SGLang behind the router too (its requests for routes go to the workers: the pool's
    # RouterClient, tests/test_multinode_engines.py and rl-sglang's test_router_client.py)
    sglang, _ = load_config(
        [MOE, "algorithm.routing_replay=true", "engine.kind=sglang", "cluster.device=cuda"]
    )
    assert sglang_server_args(sglang, memory_saver=False)["enable_return_routed_experts"]
    engine = engine_process(
        config,
        model_dir=tmp_path,
        log_dir=tmp_path,
        gpu_ids=None,
        host="127.0.0.1",
        max_batch_size=4,
    )
    assert "--enable-return-routed-experts" in engine.command()
    plain, _ = load_config([MOE])
    assert routed_experts_shape(plain) is None
    assert (
        "--enable-return-routed-experts"
        not in engine_process(
            plain,
            model_dir=tmp_path,
            log_dir=tmp_path,
            gpu_ids=None,
            host="127.0.0.1",
            max_batch_size=4,
        ).command()
    )


def test_replaying_the_engines_routes_closes_the_gap(tmp_path):
    spec = importlib.util.spec_from_file_location("routing_replay_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.measure(num_prompts=4, group=2, new_tokens=24, work_dir=tmp_path)
    assert result["own_routes_differ_frac"] > 0, result  # bf16 flipped some routes
    assert result["replayed_routes_differ_frac"] == 0.0, result  # replayed: the engine's
    with_r3, without = result["with_r3"], result["baseline_without_r3"]
    assert with_r3["mean_abs"] < without["mean_abs"], result
    assert with_r3["max_abs"] < 0.25 * without["max_abs"], result  # the flipped tokens
