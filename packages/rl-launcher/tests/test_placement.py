"""Device layout on paper: colocated and disaggregated plans, 1 and 2 nodes of 8 GPUs."""

import pytest

from rl_launcher.config import TrainConfig
from rl_launcher.config.loader import load_config
from rl_launcher.infra.placement import Slot, plan_from_config, plan_layout


def test_one_node_colocated_shares_every_device():
    plan = plan_layout(
        num_nodes=1, devices_per_node=8, num_engines=4, devices_per_engine=2, colocate=True
    )
    assert plan.num_bundles == 8 and plan.train_bundles == tuple(range(8))
    assert plan.engine_bundles == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert plan.describe() == "node 0: T0+E0 T1+E0 T2+E1 T3+E1 T4+E2 T5+E2 T6+E3 T7+E3"


def test_two_nodes_of_eight_disaggregated_layout():
    plan = plan_layout(
        num_nodes=2, devices_per_node=8, num_engines=4, devices_per_engine=2, colocate=False
    )
    assert plan.num_train_ranks == 8 and plan.train_bundles == tuple(range(8))
    assert [plan.slots[b] for b in plan.train_bundles] == [Slot(0, d) for d in range(8)]
    assert plan.engine_bundles == ((8, 9), (10, 11), (12, 13), (14, 15))
    assert {plan.slots[b].node for e in plan.engine_bundles for b in e} == {1}
    assert plan.describe().splitlines() == [
        "node 0: T0 T1 T2 T3 T4 T5 T6 T7",
        "node 1: E0 E0 E1 E1 E2 E2 E3 E3",
    ]


def test_two_nodes_of_eight_colocated_with_node_wide_engines():
    plan = plan_layout(
        num_nodes=2, devices_per_node=8, num_engines=2, devices_per_engine=8, colocate=True
    )
    assert plan.num_train_ranks == 16
    assert [plan.slots[b] for b in plan.engine_bundles[1]] == [Slot(1, d) for d in range(8)]
    wide = plan_layout(
        num_nodes=2, devices_per_node=8, num_engines=1, devices_per_engine=16, colocate=True
    )
    assert wide.engine_bundles == (tuple(range(16)),)  # one engine spanning both whole nodes


def test_disaggregated_with_explicit_ranks_leaves_spare_devices_unreserved():
    plan = plan_layout(
        num_nodes=1,
        devices_per_node=8,
        num_engines=1,
        devices_per_engine=2,
        colocate=False,
        num_train_ranks=4,
    )
    assert plan.num_bundles == 6 and plan.engine_bundles == ((4, 5),)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(
                num_nodes=1, devices_per_node=8, num_engines=4, devices_per_engine=2, colocate=False
            ),
            "split between 0 training ranks",
        ),
        (
            dict(
                num_nodes=1, devices_per_node=8, num_engines=5, devices_per_engine=2, colocate=True
            ),
            "10 engine devices",
        ),
        (
            dict(
                num_nodes=2,
                devices_per_node=8,
                num_engines=2,
                devices_per_engine=4,
                colocate=False,
                num_train_ranks=6,
            ),
            "engine 0 would straddle nodes [0, 1]",
        ),
    ],
)
def test_impossible_layouts_say_why(kwargs, message):
    with pytest.raises(ValueError, match=r"add devices|straddle") as error:
        plan_layout(**kwargs)
    assert message in str(error.value)


def test_plan_from_config():
    assert plan_from_config(TrainConfig()).describe() == "node 0: T0+E0"
    config, _ = load_config(
        [
            "cluster.num_nodes=2",
            "cluster.devices_per_node=8",
            "cluster.device=cuda",
            "cluster.colocate=false",
            "engine.num_engines=4",
            "engine.devices_per_engine=2",
            "backend.tensor_parallel=2",
        ]
    )
    assert plan_from_config(config).num_train_ranks == 8
    with pytest.raises(ValueError, match="not a multiple of tensor_parallel"):
        load_config(
            ["cluster.devices_per_node=8", "backend.num_ranks=6", "backend.tensor_parallel=4"]
        )


def test_embedded_engines_get_the_runs_context_bound_and_dtype(tmp_path):
    from rl_launcher.roles.engine_servers import engine_max_context, engine_processes

    config, _ = load_config(
        [
            "--data.max_prompt_tokens",
            "100",
            "--rollout.max_response_tokens",
            "40",
            "--eval.max_response_tokens",
            "60",
            "--model.dtype",
            "bfloat16",
        ]
    )
    assert engine_max_context(config) == 160  # the longest prompt + the longest response
    config.eval.max_response_tokens = None
    assert engine_max_context(config) == 140
    (server,) = engine_processes(
        config, model_dir=tmp_path, log_dir=tmp_path, gpus=None, max_batch_size=8
    )
    command = server.command()
    assert command[command.index("--max-context") + 1] == "140"
    assert command[command.index("--dtype") + 1] == "bfloat16"
    assert "--mem-fraction" not in command  # a CPU engine's memory is not bounded
    config.cluster.device, config.engine.mem_fraction = "cuda", 0.45
    (server,) = engine_processes(
        config, model_dir=tmp_path, log_dir=tmp_path, gpus=[[0]], max_batch_size=8
    )
    command = server.command()
    assert command[command.index("--mem-fraction") + 1] == "0.45"
    assert command[command.index("--decode-attention") + 1] == "auto"
    assert "--sampled-multi-step" not in command  # off unless asked for
    config.engine.decode_attention, config.engine.sampled_multi_step = "sdpa", True
    (server,) = engine_processes(
        config, model_dir=tmp_path, log_dir=tmp_path, gpus=[[0]], max_batch_size=8
    )
    command = server.command()
    assert command[command.index("--decode-attention") + 1] == "sdpa"
    assert "--sampled-multi-step" in command
    config.cluster.device = "cpu"
    config.rollout.function = "my_pkg.agent:generate"  # turns may grow the context
    assert engine_max_context(config) is None
    config.engine.max_context = 4096
    assert engine_max_context(config) == 4096


def test_an_embedded_engine_batches_a_steps_samples_up_to_its_devices_cap():
    from rl_launcher.roles.rollout_manager import engine_batch_limit

    config, _ = load_config(["--rollout.batch_size", "64", "--rollout.group_size", "16"])
    assert engine_batch_limit(config) == 256  # CPU: 1,024 samples, capped
    config.cluster.device = "cuda"
    assert engine_batch_limit(config) == 1024  # one admission for the whole rollout
    config.engine.num_engines = 3
    assert engine_batch_limit(config) == 342
