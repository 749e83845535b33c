"""The backend, engine and transport choices of a config, without processes: the Megatron
config and its pass-through options, SGLang command lines and GPU assignment, transports
per placement, colocation turns."""

import dataclasses
import re
import sys
import time
from pathlib import Path

import pytest

from rl_core.objective import Objective
from rl_launcher.config.loader import load_config
from rl_launcher.config.schema import AlgorithmConfig
from rl_launcher.infra.colocation import Turns, check_turns, turns_needed
from rl_launcher.infra.placement import plan_from_config
from rl_launcher.infra.weight_sync import (
    engine_senders,
    resolve_transport,
    sync_options,
    urls_of_rank,
)
from rl_launcher.roles import backends
from rl_launcher.roles.backends import OBJECTIVE_SOURCES, backend_spec, megatron_overrides
from rl_launcher.roles.engine_servers import engine_gpus, engine_processes, sglang_server_args

ROOT = Path(__file__).resolve().parents[3]
GPU_EXAMPLES = ROOT / "examples" / "gpu"


def tiny_model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    return tmp_path


def test_megatron_spec_maps_the_layout_and_pass_through_options(tmp_path):
    config, _ = load_config(
        [
            "--backend.name",
            "megatron",
            "--backend.tensor_parallel",
            "2",
            "--cluster.devices_per_node",
            "4",
            "--algorithm.kl_coef",
            "0.05",
            "--model.dtype",
            "bfloat16",
            "--optimizer.lr",
            "3e-6",
            "--megatron-sequence-parallel",
            "--megatron-logprob-chunk-size",
            "256",
        ]
    )
    spec = backend_spec(config, model_dir=tiny_model_dir(tmp_path), num_ranks=4)
    megatron = spec.config
    assert (spec.name, spec.data_parallel) == ("megatron", 2)  # 4 ranks / tp 2
    assert (megatron.tp, megatron.pp, megatron.cp, megatron.ep) == (2, 1, 1, 1)
    assert megatron.sequence_parallel is True and megatron.logprob_chunk_size == 256
    assert megatron.precision == "bf16" and megatron.lr == 3e-6 and megatron.device == "cpu"
    assert megatron.ref_path == tmp_path and megatron.objective.kl_coef == 0.05  # reference = start
    config.backend.name = "fsdp"
    fsdp = backend_spec(config, model_dir=tmp_path, num_ranks=4)
    assert (fsdp.name, fsdp.data_parallel, fsdp.config.precision) == ("fsdp", 4, "bf16")


def test_a_kl_shaped_reward_alone_loads_the_reference(tmp_path):
    """algorithm.reward_kl_coef needs the reference's log-probs, not a KL term in the loss."""
    shaped = ["--algorithm.advantage_estimator", "reinforce_plus_plus"]
    for extra, loaded in (([], False), (["--algorithm.reward_kl_coef", "0.1"], True)):
        config, _ = load_config([*shaped, *extra])
        fsdp = backend_spec(config, model_dir=tmp_path, num_ranks=1).config
        assert (fsdp.loads_reference, fsdp.objective.kl_coef) == (loaded, 0.0)
        config.backend.name = "megatron"
        megatron = backend_spec(config, model_dir=tiny_model_dir(tmp_path), num_ranks=1).config
        assert (megatron.ref_path, megatron.objective.kl_coef) == (
            tmp_path if loaded else None,
            0.0,
        )


def test_both_backends_carry_one_objective_built_from_the_config(tmp_path):
    config, _ = load_config(
        [
            "--algorithm.policy_loss",
            "gspo",
            "--algorithm.clip_high",
            "0.28",
            "--algorithm.kl_coef",
            "0.05",
            "--algorithm.kl_kind",
            "k3",
            "--algorithm.entropy_coef",
            "0.01",
            "--algorithm.rollout_is_level",
            "sequence",
            "--algorithm.rollout_is_mode",
            "mask",
            "--algorithm.rollout_is_cap",
            "3",
            "--algorithm.loss_agg_mode",
            "seq-mean-token-sum-norm",
            "--rollout.max_response_tokens",
            "48",
            "--rollout.temperature",
            "0.7",
        ]
    )
    fsdp = backend_spec(config, model_dir=tmp_path, num_ranks=1).config.objective
    config.backend.name = "megatron"
    megatron = backend_spec(config, model_dir=tiny_model_dir(tmp_path), num_ranks=1)
    assert (
        megatron.config.objective
        == fsdp
        == Objective(
            policy_loss="gspo",
            clip_high=0.28,
            kl_coef=0.05,
            kl_kind="k3",
            entropy_coef=0.01,
            rollout_is_level="sequence",
            rollout_is_mode="mask",
            rollout_is_cap=3.0,
            loss_agg_mode="seq-mean-token-sum-norm",
            norm_length=48.0,
            temperature=0.7,
        )
    )
    config.mode, config.rollout.temperature = "sft", 0.0  # greedy rollouts: logits unscaled
    sft = backend_spec(config, model_dir=tmp_path, num_ranks=1).config.objective
    assert (sft.mode, sft.temperature) == ("sft", 1.0)


def test_every_objective_field_comes_from_the_config_by_name_or_one_mapping():
    """An Objective field is read from ``algorithm.<same name>`` or named in
    OBJECTIVE_SOURCES, never both: a new option needs no edit in the launcher."""
    names = {field.name for field in dataclasses.fields(Objective)}
    by_name = names & {field.name for field in dataclasses.fields(AlgorithmConfig)}
    assert names == by_name | set(OBJECTIVE_SOURCES)
    assert not by_name & set(OBJECTIVE_SOURCES)
    assert set(OBJECTIVE_SOURCES) == {"mode", "norm_length", "temperature", "old_from_rollout"}


def test_a_new_objective_option_reaches_both_backends_with_no_other_edit(tmp_path, monkeypatch):
    """An option added to the Objective and to ``algorithm`` under one name (here an OPD
    weight) arrives in both backend configs; a field with no source is refused by name."""
    extra = [("opd_coef", float, dataclasses.field(default=0.0))]
    objective = dataclasses.make_dataclass("WithOpd", extra, bases=(Objective,), frozen=True)
    algorithm = dataclasses.make_dataclass("AlgorithmWithOpd", extra, bases=(AlgorithmConfig,))
    monkeypatch.setattr(backends, "Objective", objective)
    config, _ = load_config(["--algorithm.kl_coef", "0.05"])
    config.algorithm = algorithm(**vars(config.algorithm), opd_coef=0.5)
    for name in ("fsdp", "megatron"):
        config.backend.name = name
        spec = backend_spec(config, model_dir=tiny_model_dir(tmp_path), num_ranks=1)
        assert (spec.config.objective.opd_coef, spec.config.objective.kl_coef) == (0.5, 0.05)
    config.algorithm = AlgorithmConfig()
    with pytest.raises(
        ValueError, match=re.escape("Objective.opd_coef has no source: add algorithm.opd_coef")
    ):
        backend_spec(config, model_dir=tiny_model_dir(tmp_path), num_ranks=1)


def test_megatron_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="--megatron-tpp is not a MegatronConfig field"):
        megatron_overrides(["--megatron-tpp", "2"])
    assert megatron_overrides(["--megatron-pp=2", "--megatron-distributed-optimizer", "false"]) == {
        "pp": 2,
        "distributed_optimizer": False,
    }
    with pytest.raises(ValueError, match=re.escape("set optimizer.name=adamw")):  # at load
        load_config(["--backend.name", "megatron", "--optimizer.name", "sgd"])
    pipeline = ["backend.name=megatron", "backend.num_ranks=2", "cluster.devices_per_node=2"]
    assert load_config([*pipeline, "backend.pipeline_parallel=2"])[0].backend.pipeline_parallel == 2
    virtual = "backend.megatron={virtual_pipeline_model_parallel_size: 2}"
    with pytest.raises(ValueError, match=r"= 4 model chunks do not split the policy's 2 layers"):
        load_config([*pipeline, "backend.pipeline_parallel=2", virtual])


def gpu_config(*extra: str):
    config, _ = load_config(
        [
            "--cluster.device",
            "cuda",
            "--engine.kind",
            "sglang",
            "--model.dtype",
            "bfloat16",
            "--engine.mem_fraction",
            "0.4",
            "--sglang-attention-backend",
            "triton",
            "--sglang-skip-tokenizer-init",
            "--sglang-mem-fraction-static",
            "0.5",
            *extra,
        ]
    )
    return config


def test_sglang_servers_get_config_options_overridden_by_pass_through(tmp_path, monkeypatch):
    sglang_path = tmp_path / "sgsite"
    (sglang_path / "sglang").mkdir(parents=True)  # where the device puts SGLang
    monkeypatch.setenv("RL_SGLANG_PYTHONPATH", str(sglang_path))
    config = gpu_config("--engine.num_engines", "2", "--cluster.devices_per_node", "2")
    args = sglang_server_args(config, memory_saver=True)
    assert args == {
        "tp_size": 1,
        "mem_fraction_static": "0.5",
        "dtype": "bfloat16",
        "random_seed": 42,
        "weight_version": "0",
        "enable_memory_saver": True,
        "attention_backend": "triton",
        "skip_tokenizer_init": True,
    }
    servers = engine_processes(
        config,
        model_dir=tmp_path,
        log_dir=tmp_path,
        gpus=[[0], [1]],
        max_batch_size=8,
        memory_saver=True,
    )
    argv = servers[1].command()
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = " ".join(argv[3:])
    assert f"--model-path {tmp_path}" in flags and "--tp-size 1" in flags
    assert "--mem-fraction-static 0.5" in flags and "--enable-memory-saver" in flags
    assert "--skip-tokenizer-init" in flags and "--weight-version 0" in flags
    assert servers[1].env["CUDA_VISIBLE_DEVICES"] == "1"
    assert servers[1].env["PYTHONPATH"].split(":")[0] == str(sglang_path)
    with pytest.raises(ValueError, match="every item must be a --sglang-\\* option"):
        config.engine.sglang_args = ["stray"]
        sglang_server_args(config, memory_saver=False)


def test_sglang_graphs_cover_the_rollout_concurrency_per_engine():
    config = gpu_config("--rollout.batch_size", "64", "--rollout.group_size", "16")
    assert sglang_server_args(config, memory_saver=False)["cuda_graph_max_bs"] == 1024
    config = gpu_config("--rollout.batch_size", "50", "--rollout.group_size", "10")
    assert sglang_server_args(config, memory_saver=False)["cuda_graph_max_bs"] == 512
    config.engine.num_engines = 2  # 250 samples each: SGLang's default graphs
    assert "cuda_graph_max_bs" not in sglang_server_args(config, memory_saver=False)
    config = gpu_config("--rollout.batch_size", "64", "--sglang-cuda-graph-max-bs", "160")
    config.rollout.group_size = 16
    assert sglang_server_args(config, memory_saver=False)["cuda_graph_max_bs"] == "160"


def test_embedded_engines_on_gpus_see_only_their_devices(tmp_path):
    config, _ = load_config(
        [
            "--cluster.device",
            "cuda",
            "--cluster.colocate",
            "false",
            "--cluster.devices_per_node",
            "2",
        ]
    )
    (server,) = engine_processes(
        config, model_dir=tmp_path, log_dir=tmp_path, gpus=[[5]], max_batch_size=8
    )
    assert server.env == {"CUDA_VISIBLE_DEVICES": "5"} and "--device cuda" in " ".join(
        server.command()
    )

    class Placed:  # an OrderedPlacement's GPU ids: slot -> physical GPU
        use_gpu, gpu_ids = True, (3, 7)

    assert engine_gpus(plan_from_config(config), Placed()) == [[7]]  # the engine's bundle


def test_transport_follows_the_placement(tmp_path):
    assert resolve_transport("auto", colocate=True, device="cuda") == "tensor"
    assert resolve_transport("auto", colocate=False, device="cuda") == "distributed"
    assert resolve_transport("disk", colocate=False, device="cuda") == "disk"
    assert resolve_transport("tensor", colocate=False, device="cpu") == "tensor"  # shared memory
    with pytest.raises(ValueError, match=re.escape("with cluster.colocate=false use distributed")):
        resolve_transport("tensor", colocate=False, device="cuda")
    config = gpu_config("--cluster.colocate", "false", "--cluster.devices_per_node", "2")
    options = sync_options(config, tmp_path)
    assert options["transport"] == "distributed" and options["group_backend"] == "nccl"
    assert options["engine_kind"] == "sglang" and options["path"] == str(tmp_path / "sync_weights")


def test_each_engine_gets_tensor_handles_from_the_lowest_rank_on_its_node():
    ranks_on, engines_on = ["a", "a", "b", "b", "c"], ["b", "a", "c", "b"]
    assert engine_senders(engines_on, ranks_on, "tensor") == [2, 0, 4, 2]
    assert engine_senders(engines_on, ranks_on, "distributed") == [0, 0, 0, 0]
    with pytest.raises(ValueError, match=re.escape("engines [1, 2] are on nodes without one")):
        engine_senders(["a", "d", "d"], ["a"], "tensor")
    urls, how = ["u0", "u1", "u2", "u3"], {"senders": [2, 0, 4, 2]}
    assert [urls_of_rank(urls, rank, how) for rank in range(5)] == [
        ["u1"],
        [],
        ["u0", "u3"],
        [],
        ["u2"],
    ]
    assert urls_of_rank(urls, 0, {}) == urls and urls_of_rank(urls, 1, {}) == []


class Recorder:
    """Stands in for the trainer group and the rollout manager: records the calls (a
    ``start_*`` call returns the function that waits for it, recorded when called)."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, *args))
            if name.startswith("start_"):
                return lambda: self.calls.append((f"{name} waited",))

        return call


def test_turns_release_before_training_and_refuse_unsynced_generation():
    calls: list = []
    turns = Turns(Recorder(calls), Recorder(calls))
    turns.generating()  # first rollout: the freshly built trainer leaves the device
    turns.training()
    turns.training()  # already there: nothing
    turns.syncing()
    turns.generating()
    tags = ["weights", "kv_cache", "cuda_graph"]
    assert calls == [  # the engines hold their memory: each offload runs during the rollout
        ("start_offload",),
        ("release_memory", tags),
        ("start_offload waited",),
        ("onload",),
        ("resume_memory", tags),
        ("start_offload",),
    ]
    calls.clear()
    turns.training()
    with pytest.raises(RuntimeError, match=re.escape("engine.sync_every=1")):
        turns.generating()  # released and not synced: refused before anything moves
    assert calls == [("release_memory", tags), ("start_offload waited",), ("onload",)]


def test_after_a_rollout_the_onload_starts_before_the_batches_and_training_waits_for_it():
    calls: list = []
    turns = Turns(Recorder(calls), Recorder(calls))
    turns.generating()
    turns.preparing_training()  # the driver builds the step's batches meanwhile
    calls.append(("driver builds the batches",))
    turns.training()  # log-probs
    turns.training()  # the train step: nothing left to wait for
    turns.syncing()
    turns.generating()
    tags = ["weights", "kv_cache", "cuda_graph"]
    assert calls == [
        ("start_offload",),
        ("release_memory", tags),
        ("start_offload waited",),  # each rank's onload follows its offload anyway
        ("start_onload",),
        ("driver builds the batches",),
        ("start_onload waited",),
        ("resume_memory", tags),
        ("start_offload",),
    ]


def test_an_offload_the_engines_resume_into_is_waited_for_first():
    calls: list = []
    turns = Turns(Recorder(calls), Recorder(calls), keep_engine_weights=True)
    turns.generating()
    turns.training()
    calls.clear()
    turns.generating()  # adapter syncs: the base weights stayed, the caches resume now
    assert calls == [("offload",), ("resume_memory", ["kv_cache", "cuda_graph"])]


def test_turns_with_a_resident_trainer_or_resident_engines():
    calls: list = []
    turns = Turns(Recorder(calls), Recorder(calls), offload_trainer=False)
    turns.generating()
    turns.training()
    turns.syncing()
    turns.generating()
    tags = ["weights", "kv_cache", "cuda_graph"]
    assert calls == [("release_memory", tags), ("empty_cache",), ("resume_memory", tags)]
    calls.clear()
    turns = Turns(Recorder(calls), Recorder(calls), release_engines=False)
    turns.generating()
    turns.training()
    turns.syncing()
    turns.generating()
    turns.generating()  # no sync needed: the engines kept their weights
    assert calls == [
        ("start_offload",),
        ("start_offload waited",),
        ("onload",),
        ("start_offload",),
    ]


def test_sglang_memory_saver_only_when_the_engines_release_their_memory():
    from types import SimpleNamespace

    from rl_launcher.roles.engine_pool import EnginePool

    def saver(turns) -> bool:
        return EnginePool._memory_saver(SimpleNamespace(turns=turns))

    assert not saver(None)
    assert saver(Turns(Recorder([]), Recorder([])))
    assert not saver(Turns(Recorder([]), Recorder([]), release_engines=False))


class SlowRecorder(Recorder):
    """A Recorder whose calls take ``seconds[name]`` of wall time (a ``start_*`` call's
    waiter ``seconds[name + " wait"]``)."""

    def __init__(self, calls: list, seconds: dict):
        super().__init__(calls)
        self.seconds = seconds

    def __getattr__(self, name):
        def call(*args):
            time.sleep(self.seconds.get(name, 0.0))
            self.calls.append((name, *args))
            if name.startswith("start_"):
                return lambda: time.sleep(self.seconds.get(f"{name} wait", 0.0))

        return call


def test_turns_time_each_transition_and_the_hand_over_before_a_rollout():
    calls: list = []
    seconds = {"start_offload": 0.01, "start_offload wait": 0.05, "onload": 0.02}
    seconds["start_onload wait"] = 0.05
    trainer = SlowRecorder(calls, seconds)
    turns = Turns(trainer, SlowRecorder(calls, {"release_memory": 0.03, "resume_memory": 0.04}))
    assert turns.take_times() == {}
    turns.generating()
    turns.training()
    turns.syncing()
    times = turns.take_times()
    expected = {
        "trainer_offload": 0.01,  # started: the rollout goes on meanwhile
        "engine_release": 0.03,
        "trainer_offload_wait": 0.05,  # what the rollout did not hide
        "trainer_onload": 0.02,
        "engine_resume": 0.04,
        "in_rollout": 0.01,
    }
    for name, seconds in expected.items():
        assert seconds <= times[f"time/turns/{name}"] < seconds + 0.04, name
    total = sum(times[f"time/turns/{n}"] for n in expected if n != "in_rollout")
    assert times["time/turns"] == pytest.approx(total)
    turns.generating()  # only the offload this time (everything was resumed for the sync)
    again = turns.take_times()
    assert set(again) == {"time/turns", "time/turns/trainer_offload", "time/turns/in_rollout"}
    turns.preparing_training()  # after the rollout: the onload runs while the batches are built
    turns.training()
    onload = turns.take_times()
    assert 0.05 <= onload["time/turns/trainer_onload_wait"] < 0.05 + 0.04  # not hidden
    assert onload["time/turns/trainer_onload"] < 0.04  # started, not waited for


def test_turns_are_needed_on_shared_gpus_only():
    config = gpu_config()
    assert turns_needed(config, plan_from_config(config))
    config.cluster.colocate, config.cluster.devices_per_node = False, 2
    assert not turns_needed(config, plan_from_config(config))
    config = gpu_config("--engine.sync_every", "2")
    with pytest.raises(ValueError, match=re.escape("set engine.sync_every=1")):
        check_turns(config)
    check_turns(gpu_config("--engine.sync_every", "2", "--engine.release_when_idle", "false"))
    config = gpu_config("--backend.offload_when_idle", "false")
    assert turns_needed(config, plan_from_config(config))  # the engines still take turns
    config = gpu_config(
        "--backend.offload_when_idle", "false", "--engine.release_when_idle", "false"
    )
    assert not turns_needed(config, plan_from_config(config))
    config = gpu_config("--rollout.loop", "one_step_async")
    with pytest.raises(ValueError, match=re.escape("cluster.colocate=false or rollout.loop=sync")):
        check_turns(config)


@pytest.mark.parametrize("name", ["colocated_fsdp", "colocated_megatron", "disaggregated"])
def test_gpu_example_configs_load(name):
    config, _ = load_config(["--config", str(GPU_EXAMPLES / f"{name}.yaml")])
    assert config.cluster.device == "cuda" and config.engine.kind == "sglang"
    plan = plan_from_config(config)
    if name == "disaggregated":
        assert not plan.colocate and config.rollout.loop == "one_step_async"
        assert resolve_transport(config.engine.weight_sync, colocate=False, device="cuda") == (
            "distributed"
        )
    else:
        assert plan.colocate and turns_needed(config, plan)
        check_turns(config)


def test_a_gguf_model_path_is_checked_before_anything_starts(tmp_path):
    from rl_launcher.session.model import prepare_model

    config, _ = load_config(["--model.path", str(tmp_path / "SmolLM2.Q4_1.gguf")])
    with pytest.raises(ValueError, match=re.escape("does not exist; give a .gguf file")):
        prepare_model(config.model, run_dir=tmp_path, seed=0)


def test_backend_megatron_options_are_checked_at_load_and_passed_through(tmp_path):
    def load(options: str, name: str = "megatron"):
        return load_config(["--backend.name", name, "--backend.megatron", options])[0]

    config = load("{recompute_granularity: selective, use_distributed_optimizer: false}")
    megatron = backend_spec(config, model_dir=tiny_model_dir(tmp_path), num_ranks=1).config
    assert megatron.megatron["recompute_granularity"] == "selective"
    assert megatron.distributed_optimizer is False
    with pytest.raises(ValueError, match=r"did you mean 'recompute_granularity' \(TransformerC"):
        load("{recompute_granularty: full}")
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size .* backend.tensor_parallel"):
        load("{tensor_model_parallel_size: 2}")
    with pytest.raises(ValueError, match=r"OptimizerConfig.lr is set .* use optimizer.lr instead"):
        load("{lr: 0.1}")
    with pytest.raises(ValueError, match=r"bf16 is set by rl-megatron; use model.dtype instead"):
        load("{bf16: true}")
    with pytest.raises(ValueError, match=r"backend.megatron sets megatron-core options, but"):
        load("{recompute_granularity: full}", name="fsdp")


def test_gradient_checkpointing_is_full_recompute_on_megatron(tmp_path):
    def megatron_of(*extra: str):
        args = ["--backend.name", "megatron", "--model.gradient_checkpointing", "true", *extra]
        config = load_config(args)[0]
        return backend_spec(config, model_dir=tiny_model_dir(tmp_path), num_ranks=1).config

    assert megatron_of().megatron == backends.FULL_RECOMPUTE
    selective = {"recompute_granularity": "selective"}  # backend.megatron says how
    assert megatron_of("--backend.megatron", "{recompute_granularity: selective}").megatron == (
        selective
    )


def test_a_megatron_critic_takes_the_actors_pipeline_stages(tmp_path):
    from rl_launcher.roles.critic import critic_config

    args = ["--backend.name", "megatron", "--algorithm.advantage_estimator", "gae"]
    args += ["--backend.num_ranks", "2", "--cluster.devices_per_node", "2"]
    config = load_config([*args, "--backend.pipeline_parallel", "2"])[0]
    actor = backend_spec(config, model_dir=tiny_model_dir(tmp_path), num_ranks=2).config
    critic = critic_config(actor, config.optimizer)
    assert (critic.critic, critic.pp) == (True, 2)


def test_the_lr_schedule_ends_at_num_steps_whatever_the_minibatch_count(tmp_path):
    """Backends step their schedule once per optimizer update; with 4 minibatches a step,
    warm-up and decay are 4x as many updates, so cosine reaches its floor at num_steps."""
    args = ["--num_steps", "30", "--algorithm.num_minibatches", "4"]
    args += ["--optimizer.schedule", "cosine", "--optimizer.warmup_steps", "2"]
    config, _ = load_config(args)
    fsdp = backend_spec(config, model_dir=tmp_path, num_ranks=1).config
    assert (fsdp.warmup_steps, fsdp.total_steps) == (8, 120)
    config.backend.name = "megatron"
    megatron = backend_spec(config, model_dir=tiny_model_dir(tmp_path), num_ranks=1).config
    assert (megatron.warmup_steps, megatron.total_steps) == (8, 120)
