"""slime's algorithm switches (issue 31) in the launcher: each bad combination refused
before Ray with a message naming the field and the way out, the options reaching the
Objective and the backend configs, and the driver-side pieces (old log-probs from the
rollout, the log-prob gap gate, train-batch dumps, replay subsampling) on real batches.
The end-to-end run is in test_slime_switches_run.py."""

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from rl_core.batch import TrainBatch
from rl_launcher.config.loader import load_config
from rl_launcher.infra.dumps import subsample
from rl_launcher.infra.faults import RunStopped, check_logprob_gap
from rl_launcher.roles.backends import fsdp_config, megatron_config, objective_of

KL = ["--algorithm.kl_coef", "0.1"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--algorithm.old_log_probs", "rollout", "--algorithm.rollout_is_level", "token"],
            "or use algorithm.old_log_probs=recompute",
        ),
        (
            ["--algorithm.opsm", "true", "--algorithm.old_log_probs", "train_step"],
            "use old_log_probs=recompute or rollout, or opsm=false",
        ),
        (["--algorithm.unbiased_kl", "true"], "set kl_coef > 0 or unbiased_kl=false"),
        (
            ["--algorithm.ref_update_interval", "2"],
            "set algorithm.kl_coef or reward_kl_coef > 0, or unset algorithm.ref_update_interval",
        ),
        ([*KL, "--algorithm.ref_path", "/nonexistent"], "is not a Hugging Face model directory"),
        (
            [*KL, "--algorithm.ref_update_interval", "2", "--model.lora_rank", "4"],
            "unset algorithm.ref_update_interval or train without LoRA",
        ),
        (
            ["--algorithm.critic_warmup_steps", "2"],
            "set advantage_estimator=gae or critic_warmup_steps=0",
        ),
        (["--algorithm.value_clip", "0"], "algorithm.value_clip: must be > 0"),
        (["--algorithm.max_logprob_gap", "0"], "algorithm.max_logprob_gap: must be > 0"),
        (["--algorithm.opsm_delta", "-1"], "algorithm.opsm_delta: must be >= 0"),
        (["--algorithm.ref_update_interval", "-1"], "must be >= 0"),
        (
            ["--rollout.replay_fraction", "0.5"],
            "set rollout.replay_dir (dumps of rollout.dump_dir) or replay_fraction=1",
        ),
        (["--rollout.replay_fraction", "0"], "rollout.replay_fraction: must be > 0"),
        (
            ["--logging.dump_train_batch", "true", "--rollout.rollout_only", "true"],
            "logging.dump_train_batch writes the RL loop's train batches",
        ),
        (["--model.freeze", "[o_porj]"], "model.freeze: ['o_porj'] match no parameter name"),
        (["--model.train_only", "['(']"], "model.train_only: '(' is not a Python regular"),
        (
            ["--model.train_only", "[mlp]", "--model.freeze", "[proj]"],
            "leaves no parameter to train",
        ),
        (
            ["--model.freeze", "[embed]", "--model.lora_rank", "4"],
            "LoRA (model.lora_rank > 0) trains only its adapters",
        ),
    ],
)
def test_bad_switches_are_refused_naming_the_field(argv, message):
    with pytest.raises(ValueError) as error:
        load_config(argv)
    assert message in str(error.value)


def test_switches_reach_the_objective_and_both_backend_configs(tmp_path):
    argv = [
        *KL,
        "--algorithm.old_log_probs",
        "rollout",
        "--algorithm.unbiased_kl",
        "true",
        "--algorithm.opsm",
        "true",
        "--algorithm.opsm_delta",
        "0.01",
        "--model.train_only",
        "[mlp, norm]",
        "--model.freeze",
        "['layers\\.1\\.']",
        "--algorithm.value_clip",
        "0.5",
    ]
    config, _ = load_config(argv)
    objective = objective_of(config)
    assert objective.old_from_rollout and objective.unbiased_kl and objective.opsm
    assert objective.opsm_delta == 0.01
    fsdp = fsdp_config(config, model_dir=tmp_path)
    assert fsdp.train_only == ("mlp", "norm") and fsdp.freeze == ("layers\\.1\\.",)
    assert fsdp.value_clip == 0.5 and fsdp.ref_path is None
    config.algorithm.ref_path = str(tmp_path / "ref")
    AutoConfig.for_model(**config.model.init_config).save_pretrained(tmp_path)  # Megatron reads it
    megatron = megatron_config(config, model_dir=tmp_path)
    assert megatron.ref_path == tmp_path / "ref" and megatron.train_only == ("mlp", "norm")
    assert fsdp_config(config, model_dir=tmp_path).ref_path == str(tmp_path / "ref")


def _batch(old, rollout):
    return TrainBatch(
        tokens=torch.arange(3),
        cu_seqlens=torch.tensor([0, 3], dtype=torch.int32),
        loss_mask=torch.tensor([1.0, 1.0, 0.0]),
        old_log_probs=old,
        rollout_log_probs=rollout,
    )


class _Run:
    """What the train-phase helpers read of a run: its config and a trainer that must not
    be asked for log-probs when they come from the rollout."""

    def __init__(self, config):
        self.config, self.trainer = config, self

    def log_probs(self, batches):
        raise AssertionError("old_log_probs=rollout must not recompute")


def test_rollout_old_log_probs_are_the_engines_and_refused_when_missing():
    from rl_launcher.loops.train_phase import with_old_policy

    config, _ = load_config(["--algorithm.old_log_probs", "rollout"])
    rollout = torch.tensor([-0.5, -0.25, 0.0])
    (batch,) = with_old_policy(_Run(config), [_batch(None, rollout)])
    assert torch.equal(batch.old_log_probs, rollout)
    with pytest.raises(ValueError, match=r"use algorithm\.old_log_probs=recompute"):
        with_old_policy(_Run(config), [_batch(None, None)])


def test_the_gap_gate_stops_above_the_bound_only():
    config, _ = load_config(["--algorithm.max_logprob_gap", "0.1"])
    check_logprob_gap(config, 3, {"mismatch/logprob_abs_diff_mean": 0.1})
    check_logprob_gap(config, 3, {})  # a step without the metric (nothing trained)
    with pytest.raises(RunStopped, match=r"step 3: .* differ by 0.25 .*max_logprob_gap=0.1"):
        check_logprob_gap(config, 3, {"mismatch/logprob_abs_diff_mean": 0.25})
    unset, _ = load_config([])
    check_logprob_gap(unset, 3, {"mismatch/logprob_abs_diff_mean": 9.0})


def test_train_batches_are_dumped_per_rank(tmp_path):
    from rl_launcher.loops.train_phase import dump_train_batches

    config, _ = load_config(
        ["--logging.dump_train_batch", "true", "--logging.run_dir", str(tmp_path)]
    )
    batches = [_batch(torch.zeros(3), torch.ones(3)), _batch(None, torch.ones(3))]
    dump_train_batches(_Run(config), 7, batches)
    saved = torch.load(Path(tmp_path) / "train_batches/step_000007.pt")
    assert saved["step"] == 7 and len(saved["rank_batches"]) == 2
    first, second = saved["rank_batches"]
    assert torch.equal(first["old_log_probs"], torch.zeros(3)) and second["old_log_probs"] is None
    assert torch.equal(first["tokens"], torch.arange(3))


def test_replay_subsample_keeps_a_seeded_ordered_fraction():
    groups = [[i] for i in range(10)]
    half = subsample(groups, 0.5, seed=3)
    assert len(half) == 5 and half == sorted(half) and half == subsample(groups, 0.5, seed=3)
    assert half != subsample(groups, 0.5, seed=4)
    assert subsample(groups, 1.0, seed=3) == groups
    assert len(subsample(groups, 0.01, seed=3)) == 1  # at least one group


class _Trainer:
    """Records the calls the train phase makes (the real group runs in the run test)."""

    def __init__(self):
        self.calls = []

    def train_steps(self, parts):
        self.calls.append("train_steps")
        return {"loss/pg": 1.0}

    def update_reference(self):
        self.calls.append("update_reference")


def test_critic_warmup_skips_the_policy_update_and_the_reference_refreshes_every_n():
    from rl_launcher.loops.train_phase import refresh_reference, train_policy

    gae = ["--algorithm.advantage_estimator", "gae", "--algorithm.critic_warmup_steps", "2"]
    config, _ = load_config([*gae, *KL, "--algorithm.ref_update_interval", "3"])
    run = _Run(config)
    run.trainer = _Trainer()
    warm = [train_policy(run, step, parts=[]) for step in (1, 2, 3)]
    assert warm[:2] == [{"actor/frozen_for_critic_warmup": 1.0}] * 2 and warm[2] == {"loss/pg": 1.0}
    refreshed = [refresh_reference(run, step) for step in range(1, 7)]
    assert [bool(r) for r in refreshed] == [False, False, True, False, False, True]
    assert run.trainer.calls == ["train_steps", "update_reference", "update_reference"]


def test_every_done_row_of_the_slime_table_names_a_test_that_exists():
    """docs/slime_features.md: a feature marked done names at least one test function,
    and every test it names exists (package/tests file::function)."""
    import re

    root = Path(__file__).resolve().parents[3]
    rows = [
        r for r in (root / "docs/slime_features.md").read_text().splitlines() if r.startswith("| `")
    ]
    assert len(rows) > 80
    for row in rows:
        flags, status, _, tests = (cell.strip() for cell in row.strip("|").split("|"))
        assert status in ("done", "partial", "missing"), row
        refs = re.findall(r"(rl-[a-z]+)/(test_\w+\.py)(?:::(\w+))?", tests)
        if status == "done":
            assert any(name for _, _, name in refs), f"{flags}: done without a test"
        for package, file, name in refs:
            source = (root / "packages" / package / "tests" / file).read_text()
            assert not name or f"def {name}(" in source, f"{flags}: {file}::{name} not found"


def test_only_a_checkpoint_from_before_saved_references_makes_the_resumed_policy_it(capsys):
    """A checkpoint's trainer holds a refreshed reference (the e2e resume test checks that it
    is the uninterrupted run's); one written before (no reference_saved in its state) gets
    the resumed policy, saying which step's policy the reference should have been."""
    from rl_launcher.loops.train_phase import REFERENCE_SAVED, restore_reference

    config, _ = load_config([*KL, "--algorithm.ref_update_interval", "4"])
    run = _Run(config)
    run.trainer = _Trainer()
    restore_reference(run, None)  # a fresh start
    restore_reference(run, (Path("ckpt"), {"step": 10, REFERENCE_SAVED: True}))
    restore_reference(run, (Path("old"), {"step": 3}))  # before the first refresh
    assert run.trainer.calls == [] and capsys.readouterr().err == ""
    restore_reference(run, (Path("old"), {"step": 10}))
    assert run.trainer.calls == ["update_reference"]
    assert "the reference is the policy of step 10, not of step 8" in capsys.readouterr().err


def test_the_gap_of_a_step_is_its_first_minibatchs():
    """With old log-probs from the rollout (or the train step) each minibatch measures the
    gap in its own forward; only the first runs on the weights the engines sampled with."""
    from rl_launcher.infra.faults import merge_minibatch_metrics

    first = {"mismatch/logprob_abs_diff_mean": 0.01, "loss/pg": 1.0}
    later = {"mismatch/logprob_abs_diff_mean": 0.3, "loss/pg": 2.0}
    merged = merge_minibatch_metrics(merge_minibatch_metrics({}, first), later)
    assert merged == {"mismatch/logprob_abs_diff_mean": 0.01, "loss/pg": 2.0}


def test_a_finished_step_past_the_gap_bound_is_recorded_then_stops_the_run():
    """The loops' finish_step records the step first, then the gate stops the run."""
    from types import SimpleNamespace

    from rl_launcher.loops.step import finish_step

    config, _ = load_config(["--algorithm.max_logprob_gap", "0.1", "--logging.progress", "false"])
    recorded = []
    run = SimpleNamespace(
        config=config,
        extras={},
        metrics_log=SimpleNamespace(append=lambda step, m: recorded.append(step)),
    )
    metrics = {"mismatch/logprob_abs_diff_mean": 0.2, "train/num_samples": 8.0}
    with pytest.raises(RunStopped, match=r"algorithm\.max_logprob_gap=0\.1"):
        finish_step(run, 1, metrics, save_fn=None)
    assert recorded == [1]


def write_tiny_gguf(path: Path, *, hidden=16, ffn=32, vocab=32, num_layers=2) -> Path:
    """A two-layer llama GGUF (float32 tensors, a placeholder vocabulary) written with the
    gguf package's writer, as llama.cpp's converter lays one out."""
    import gguf
    import numpy as np

    writer, rng = gguf.GGUFWriter(str(path), "llama"), np.random.default_rng(0)
    writer.add_block_count(num_layers)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}".encode() for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([1] * vocab)
    shapes = {"token_embd": (vocab, hidden), "output_norm": (hidden,), "output": (vocab, hidden)}
    for i in range(num_layers):
        shapes |= {f"blk.{i}.{n}": (hidden,) for n in ("attn_norm", "ffn_norm")}
        shapes |= {f"blk.{i}.{n}": (hidden, hidden) for n in ("attn_q", "attn_output")}
        shapes |= {f"blk.{i}.{n}": (hidden // 2, hidden) for n in ("attn_k", "attn_v")}
        shapes |= {f"blk.{i}.{n}": (ffn, hidden) for n in ("ffn_gate", "ffn_up")}
        shapes[f"blk.{i}.ffn_down"] = (hidden, ffn)
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_freezing_patterns_of_a_gguf_model_are_checked_at_load(tmp_path):
    """The names come from the GGUF's header (its config on a meta skeleton): those of the
    model the loader converts the file to; a pattern matching none is refused at load."""
    pytest.importorskip("gguf", reason="uv sync --extra gguf")
    from rl_launcher.config.switch_checks import hf_parameter_names
    from rl_launcher.session.model import load_gguf

    path = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    config, _ = load_config(
        ["--model.path", path, "--model.freeze", "[embed_tokens, layers\\.0\\.]"]
    )
    loaded, _ = load_gguf(Path(path))
    assert hf_parameter_names(config) == [name for name, _ in loaded.named_parameters()]
    with pytest.raises(ValueError, match=re.escape("model.freeze: ['token_embd'] match no")):
        load_config(["--model.path", path, "--model.freeze", "[token_embd]"])  # GGUF's name
    with pytest.raises(ValueError, match=r"model\.train_only: \['layers\\\\\.2"):
        load_config(["--model.path", path, "--model.train_only", "[layers\\.2\\.]"])
    with pytest.raises(ValueError, match=r"does not exist; give a \.gguf file"):
        load_config(["--model.path", str(tmp_path / "gone.gguf"), "--model.freeze", "[mlp]"])
