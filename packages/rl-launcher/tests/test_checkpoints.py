"""Checkpoint manifests and the choice ``--resume`` makes, on directories laid out like a
run's (an rl-fsdp trainer part: ``dcp/`` shards and ``trainer_state.pt``), no processes."""

import json
import shutil
from pathlib import Path

import pytest
from ray.exceptions import RayTaskError
from torch.distributed.checkpoint.api import CheckpointException

from rl_launcher.config.loader import parse_command_line
from rl_launcher.infra import checkpoints
from rl_launcher.infra.resume_choice import choose, loading, set_aside_after

SHARD = "trainer/dcp/__0_0.distcp"
TRAINER_STATE = "trainer/trainer_state.pt"


def saved(root: Path, step: int, *, manifest: bool = True) -> Path:
    """A finished checkpoint of ``step``: trainer files, then state.json and the manifest
    (``manifest=False``: as saved before manifests existed)."""
    path = checkpoints.step_path(root, step)
    (path / "trainer" / "dcp").mkdir(parents=True, exist_ok=True)
    (path / SHARD).write_bytes(bytes(100))
    (path / "trainer" / "dcp" / ".metadata").write_bytes(bytes(30))
    (path / TRAINER_STATE).write_bytes(bytes(7))
    checkpoints.write_state(path, {"step": step, "weight_version": step})
    if not manifest:
        (path / checkpoints.MANIFEST_FILE).unlink()
    return path


def test_manifest_lists_every_file_with_its_size(tmp_path):
    path = saved(tmp_path, 10)
    manifest = json.loads((path / checkpoints.MANIFEST_FILE).read_text())
    state_size = (path / checkpoints.STATE_FILE).stat().st_size
    assert manifest == {
        "files": {
            "state.json": state_size,
            "trainer/dcp/.metadata": 30,
            SHARD: 100,
            TRAINER_STATE: 7,
        }
    }
    assert not list(path.glob("*.tmp"))
    assert checkpoints.damage(path) is None


def _empty_state(path):
    (path / "state.json").write_text("")


def _garbled_state(path):
    (path / "state.json").write_text('{"step": 1')


def _truncated_shard(path):
    (path / SHARD).write_bytes(bytes(40))


def _grown_shard(path):
    (path / SHARD).write_bytes(bytes(120))


def _missing_trainer_state(path):
    (path / TRAINER_STATE).unlink()


def _garbled_manifest(path):
    (path / checkpoints.MANIFEST_FILE).write_text("[1, 2]")


@pytest.mark.parametrize(
    ("harm", "why"),
    [
        (_empty_state, "state.json empty"),
        (_garbled_state, "state.json is not JSON (Expecting ',' delimiter: line 1 column 11"),
        (_truncated_shard, f"{SHARD} truncated (40 of 100 bytes)"),
        (_grown_shard, f"{SHARD} has 120 bytes, manifest.json says 100"),
        (_missing_trainer_state, f"{TRAINER_STATE} missing"),
        (_garbled_manifest, "manifest.json unreadable"),
    ],
)
def test_manifest_check_names_what_is_wrong(tmp_path, harm, why):
    path = saved(tmp_path, 10)
    harm(path)
    assert checkpoints.damage(path).startswith(why)
    assert checkpoints.complete_checkpoints(tmp_path) == []


def test_extra_files_do_not_damage_a_checkpoint(tmp_path):
    path = saved(tmp_path, 10)
    (path / "hf").mkdir()  # rl-eval exports a checkpoint's weights into it later
    (path / "hf" / "model.safetensors").write_bytes(bytes(50))
    (path / "notes.txt").write_text("kept by hand")
    assert checkpoints.damage(path) is None
    assert checkpoints.complete_checkpoints(tmp_path) == [(10, path)]


def test_an_export_may_be_removed_whole_but_not_damaged(tmp_path):
    path = checkpoints.step_path(tmp_path, 10)
    (path / "hf").mkdir(parents=True)  # checkpoint.save_hf: written with the checkpoint
    (path / "hf" / "model.safetensors").write_bytes(bytes(50))
    (path / "hf" / "config.json").write_text("{}")
    saved(tmp_path, 10)
    (path / "hf" / "model.safetensors").write_bytes(bytes(20))
    assert checkpoints.damage(path) == "hf/model.safetensors truncated (20 of 50 bytes)"
    (path / "hf" / "model.safetensors").unlink()
    assert checkpoints.damage(path) == "hf/model.safetensors missing"
    shutil.rmtree(path / "hf")  # removed on purpose: rl-eval exports it again
    assert checkpoints.damage(path) is None


def test_checkpoint_without_manifest_needs_its_state_and_trainer_mark(tmp_path):
    old = saved(tmp_path, 10, manifest=False)
    assert checkpoints.damage(old) is None
    _truncated_shard(old)  # cannot be seen without a manifest
    assert checkpoints.damage(old) is None
    _missing_trainer_state(old)
    assert checkpoints.damage(old) == "trainer/trainer_state.pt or trainer/meta.json missing"
    other = saved(tmp_path, 20, manifest=False)
    _empty_state(other)
    assert checkpoints.damage(other) == "state.json empty"
    unfinished = checkpoints.step_path(tmp_path, 30)
    (unfinished / "trainer").mkdir(parents=True)
    assert checkpoints.damage(unfinished).startswith("unfinished (no state.json")


def test_resume_falls_back_from_a_damaged_newest_checkpoint(tmp_path, capsys):
    step10 = saved(tmp_path, 10)
    step20 = saved(tmp_path, 20)
    _missing_trainer_state(step20)
    path, state = choose(tmp_path)
    assert path == step10 and state == {"step": 10, "weight_version": 10}
    err = capsys.readouterr().err
    assert err == f"rl-train: checkpoint {step20}: {TRAINER_STATE} missing; using step_000010\n"


def test_resume_skips_each_newer_checkpoint_with_its_reason(tmp_path, capsys):
    step10 = saved(tmp_path, 10, manifest=False)  # written before manifests
    _empty_state(saved(tmp_path, 20))
    (checkpoints.step_path(tmp_path, 30) / "trainer").mkdir(parents=True)  # killed mid-save
    assert choose(tmp_path)[0] == step10
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith(
        "step_000030: unfinished (no state.json: its save was interrupted); using step_000010"
    )
    assert lines[1].endswith("step_000020: state.json empty; using step_000010")
    assert lines[2].startswith(f"rl-train: checkpoint {step10} has no manifest.json")
    assert len(lines) == 3


def test_resume_with_nothing_loadable(tmp_path, capsys):
    assert choose(tmp_path / "missing") is None
    (checkpoints.step_path(tmp_path, 10) / "trainer").mkdir(parents=True)
    assert choose(tmp_path) is None  # only a save that never finished: start at step 1
    _truncated_shard(saved(tmp_path, 20))
    with pytest.raises(
        ValueError,
        match=r"no loadable checkpoint in .*step_000020: "
        rf"{SHARD} truncated \(40 of 100 bytes\); step_000010: unfinished",
    ):
        choose(tmp_path)


def test_resume_step_or_path_picks_one_and_names_what_is_wrong(tmp_path):
    step10, step20, step30 = (saved(tmp_path, step) for step in (10, 20, 30))
    _truncated_shard(step30)
    assert choose(tmp_path, 10)[0] == step10
    assert choose(tmp_path, "20")[0] == step20  # rl-train --resume 20
    assert choose(tmp_path, str(step10))[1]["step"] == 10
    with pytest.raises(
        ValueError,
        match=r"--resume 7: no checkpoint of step 7; loadable "
        rf"checkpoints in {tmp_path}: step 10, 20$",
    ):
        choose(tmp_path, 7)
    with pytest.raises(ValueError, match=rf"^checkpoint {step30}: {SHARD} truncated"):
        choose(tmp_path, 30)
    with pytest.raises(ValueError, match="no such directory; give a step number"):
        choose(tmp_path, str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="a directory of checkpoints, not one"):
        choose(tmp_path, str(tmp_path))


def test_prune_never_counts_or_deletes_a_damaged_checkpoint(tmp_path):
    step10 = saved(tmp_path, 10)
    _truncated_shard(saved(tmp_path, 20))
    checkpoints.prune(tmp_path, keep_last=1)  # step 10 is the only loadable one: kept
    assert step10.is_dir() and checkpoints.step_path(tmp_path, 20).is_dir()
    saved(tmp_path, 30)
    checkpoints.prune(tmp_path, keep_last=1)
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step_000020", "step_000030"]


def test_resumed_run_moves_later_step_directories_aside(tmp_path, capsys):
    saved(tmp_path, 10)
    _truncated_shard(saved(tmp_path, 20))
    (checkpoints.step_path(tmp_path, 30) / "trainer").mkdir(parents=True)
    saved(tmp_path, 40)
    (tmp_path / "step_000040.superseded").mkdir()  # from an earlier resume
    set_aside_after(tmp_path, 10)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "step_000010",
        "step_000020.damaged",
        "step_000040.superseded",
        "step_000040.superseded1",
    ]
    assert checkpoints.complete_checkpoints(tmp_path) == [(10, tmp_path / "step_000010")]
    assert "(damaged) to step_000020.damaged; the run redoes step 20" in capsys.readouterr().err


def test_errors_while_loading_name_the_checkpoint(tmp_path):
    path = tmp_path / "step_000010"
    named = rf"^checkpoint {path} could not be loaded: "
    with pytest.raises(ValueError, match=named + "KeyError: 'data'$"), loading(path):
        _ = {}["data"]
    remote = RayTaskError("load", "Traceback (most recent call last): ...", OSError("short"))
    with pytest.raises(ValueError, match=named + "OSError: short$"), loading(path):
        raise remote.as_instanceof_cause()
    # an rl-fsdp rank's error: torch.distributed.checkpoint's, whose text is a traceback
    corrupt = "PytorchStreamReader failed reading zip archive: failed finding central directory"
    per_rank = CheckpointException("load", {0: (RuntimeError(f"{corrupt}. {'x' * 300}"), [])})
    remote = RayTaskError("load", "Traceback ...", per_rank)
    cut = rf"RuntimeError: {corrupt}\. x+\.\.\.$"  # the first line, at most 200 characters
    with pytest.raises(ValueError, match=named + cut), loading(path):
        raise remote.as_instanceof_cause()
    with pytest.raises(ZeroDivisionError), loading(path):  # a bug, not a bad checkpoint
        _ = 1 / 0


@pytest.mark.parametrize(
    ("argv", "value", "overrides"),
    [
        (["--resume"], None, []),
        (["--resume", "20", "-c", "x.yaml"], "20", []),
        (["--resume=runs/a/step_000010"], "runs/a/step_000010", []),
        (["--resume", "runs/a/step_000010"], "runs/a/step_000010", []),
        (["--resume", "--num_steps", "4"], None, [("num_steps", "4")]),
        (["--resume", "rollout.batch_size=4"], None, [("rollout.batch_size", "4")]),
    ],
)
def test_resume_flag_takes_an_optional_step_or_path(argv, value, overrides):
    parsed = parse_command_line(argv, flags=("--print-config",), valued_flags=("--resume",))
    assert parsed.flags == {"--resume"}
    assert parsed.flag_values.get("--resume") == value
    assert parsed.overrides == overrides
