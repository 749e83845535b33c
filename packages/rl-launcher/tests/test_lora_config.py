"""model.lora_*: mapped onto rl-fsdp's LoRASpec for the actor (off by default), refused
before Ray starts where no adapters exist (megatron) or none would be added."""

import pytest

from rl_fsdp.lora import DEFAULT_TARGETS, LoRASpec
from rl_launcher.config.loader import load_config
from rl_launcher.config.schema import LORA_TARGETS
from rl_launcher.roles.backends import fsdp_config


def test_lora_settings_reach_the_fsdp_config(tmp_path):
    config, _ = load_config([])
    assert fsdp_config(config, model_dir=tmp_path).lora is None  # full fine-tuning
    config, _ = load_config(
        [
            "model.lora_rank=8",
            "model.lora_alpha=32",
            "model.lora_targets=[q_proj, v_proj]",
            "mode=sft",
        ]
    )
    spec = fsdp_config(config, model_dir=tmp_path).lora
    assert spec == LoRASpec(rank=8, alpha=32.0, dropout=0.0, targets=("q_proj", "v_proj"))
    assert spec.scaling == 4.0
    assert LORA_TARGETS == DEFAULT_TARGETS  # the schema's default is rl-fsdp's


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["model.lora_rank=8", "backend.name=megatron"], r"backend\.name=fsdp only.*lora_rank=0"),
        (["model.lora_rank=8", "model.lora_targets=[]"], r"lora_targets is empty.*q_proj"),
        (["model.lora_dropout=1.0"], r"model\.lora_dropout"),
        (["model.lora_rank=8", "rollout.source=buffer"], r"lora_sync=adapter.*lora_sync=merged"),
    ],
)
def test_bad_lora_settings_are_refused_before_anything_starts(args, message):
    with pytest.raises(ValueError, match=message):
        load_config(args)


def engine_command(args: list[str], tmp_path) -> list[str]:
    from rl_launcher.roles.engine_servers import engine_process

    config, _ = load_config(args)
    server = engine_process(
        config,
        model_dir=tmp_path,
        log_dir=tmp_path,
        gpu_ids=None,
        host="127.0.0.1",
        max_batch_size=8,
    )
    return server.command()


def option_values(argv: list[str], flag: str) -> list[str]:
    """The values after ``flag`` up to the next option."""
    start = argv.index(flag) + 1
    end = next((i for i in range(start, len(argv)) if argv[i].startswith("--")), len(argv))
    return argv[start:end]


@pytest.mark.parametrize("kind", ["sglang", "embedded"])
def test_adapter_sync_starts_engines_that_load_adapters(kind, tmp_path, monkeypatch):
    """lora_sync=adapter (the default with LoRA): SGLang gets --enable-lora, the rank and
    the run's target modules (it cannot load adapters otherwise), the embedded engine the
    same options; merged or no LoRA: none."""
    (tmp_path / "sgsite" / "sglang").mkdir(parents=True)  # where the device puts SGLang
    monkeypatch.setenv("RL_SGLANG_PYTHONPATH", str(tmp_path / "sgsite"))
    device = "cuda" if kind == "sglang" else "cpu"
    lora = ["model.lora_rank=16", "model.lora_targets=[q_proj, v_proj]", f"engine.kind={kind}"]
    lora += [f"cluster.device={device}", "model.dtype=bfloat16"]
    argv = engine_command(lora, tmp_path)
    assert "--enable-lora" in argv
    assert option_values(argv, "--max-lora-rank") == ["16"]
    assert option_values(argv, "--lora-target-modules") == ["q_proj", "v_proj"]
    for args in ([*lora, "model.lora_sync=merged"], lora[2:]):  # merged; no LoRA
        argv = engine_command(args, tmp_path)
        assert not any("lora" in arg for arg in argv)


def test_sync_options_carry_the_lora_sync_mode(tmp_path):
    from rl_launcher.infra.weight_sync import sync_options

    modes = []
    for args in (["model.lora_rank=8"], ["model.lora_rank=8", "model.lora_sync=merged"], []):
        config, _ = load_config(args)
        modes.append(sync_options(config, tmp_path)["lora_sync"])
    assert modes == ["adapter", "merged", None]


def test_engines_keep_the_two_newest_adapters_of_the_run(tmp_path):
    from rl_launcher.roles.lora import adapter_name, remove_old_dirs, stale_adapters

    loaded = {adapter_name(v): "p" for v in (9, 10, 8, 11)} | {"someone_elses": "p"}
    assert stale_adapters(loaded, keep=2) == ["policy_v8", "policy_v9"]
    assert stale_adapters({"policy_v3": "p"}, keep=2) == []
    for version in (1, 2, 10):
        (tmp_path / adapter_name(version)).mkdir()
    (tmp_path / "policy_v10.tmp").mkdir()  # a write in progress is not a version
    remove_old_dirs(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "policy_v10",
        "policy_v10.tmp",
        "policy_v2",
    ]


class Recorder:
    """Stands in for the trainer and the engine pool: records what the turns ask of them."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


@pytest.mark.parametrize(
    ("lora_sync", "released"),
    [("adapter", ["kv_cache", "cuda_graph"]), ("merged", ["weights", "kv_cache", "cuda_graph"])],
)
def test_colocated_engines_keep_the_base_weights_an_adapter_sync_never_refills(lora_sync, released):
    from rl_launcher.infra.colocation import make_turns

    config, _ = load_config(["model.lora_rank=8", f"model.lora_sync={lora_sync}"])
    calls: list = []
    turns = make_turns(config, Recorder(calls), Recorder(calls))
    turns.training()
    turns.syncing()
    turns.generating()
    turns.training()
    assert [call for call in calls if call[0].endswith("_memory")] == [
        ("release_memory", released),
        ("resume_memory", released),
        ("release_memory", released),
    ]
