"""What a run reads back from its own directories stays inside them: a symlink planted in
the checkpoint or dump directory is ignored (and named), never followed."""

from rl_launcher.infra import checkpoints
from rl_launcher.infra.dumps import dump_files, dump_path
from rl_launcher.infra.paths import contained


def _checkpoint(root, step, weight_version):
    path = checkpoints.step_path(root, step)
    path.mkdir(parents=True)
    checkpoints.write_state(path, {"step": step, "weight_version": weight_version})
    return path


def test_contained_resolves_symlinks_and_dot_dots(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "link").symlink_to(tmp_path)
    assert contained(tmp_path / "run", tmp_path / "run" / "a" / "b")
    assert not contained(tmp_path / "run", tmp_path / "run" / ".." / "x")
    assert not contained(tmp_path / "run", tmp_path / "run" / "link" / "x")


def test_resume_ignores_a_checkpoint_linked_from_outside(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    _checkpoint(root, 2, weight_version=2)
    planted = _checkpoint(tmp_path / "elsewhere", 9, weight_version=666)
    (root / "step_000009").symlink_to(planted, target_is_directory=True)
    path, state = checkpoints.newest(root)
    assert path.name == "step_000002" and state["weight_version"] == 2
    assert "ignoring checkpoint" in capsys.readouterr().err
    checkpoints.prune(root, keep_last=1)  # never deletes through the link
    assert (planted / checkpoints.STATE_FILE).is_file()


def test_replay_ignores_a_dump_linked_from_outside(tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    dump_path(dumps, 1).write_text("")
    outside = tmp_path / "secret.jsonl"
    outside.write_text("")
    dump_path(dumps, 2).symlink_to(outside)
    assert dump_files(dumps) == [dump_path(dumps, 1)]
