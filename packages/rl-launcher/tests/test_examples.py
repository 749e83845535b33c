"""Every example config loads and validates, and the data files it names exist."""

from pathlib import Path

import pytest

from rl_launcher.config.loader import load_config
from rl_launcher.data.reader import parse_spec
from rl_launcher.infra.checkpoints import checkpoint_dir, step_path

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = sorted((ROOT / "examples").glob("*/*.yaml"))


def test_examples_are_found():
    names = {path.parent.name for path in CONFIGS}
    assert {"quickstart", "ppo", "sft_then_grpo", "multiturn", "distill"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_example_config_validates_and_its_files_exist(path):
    config, _ = load_config(["--config", str(path)])
    assert (path.parent / "README.md").is_file(), "every example has a README"
    for spec in [*config.data.train, *config.eval.datasets]:
        assert (ROOT / parse_spec(spec.path)[0]).is_file(), spec.path
    if config.model.tokenizer_path is not None:
        assert (ROOT / config.model.tokenizer_path).is_dir()


def test_distill_student_scores_with_the_teacher_example_writes():
    """examples/distill: the student's teacher_path is the HF export of the teacher run's
    last step, and the README's GRPO-alone baseline (distill.coef=0, no teacher) validates."""
    folder = ROOT / "examples" / "distill"
    teacher, _ = load_config(["--config", str(folder / "teacher.yaml")])
    student, _ = load_config(["--config", str(folder / "student.yaml")])
    last = step_path(checkpoint_dir(teacher), teacher.num_steps)
    assert teacher.checkpoint.save_hf and teacher.num_steps % teacher.checkpoint.interval == 0
    assert student.distill.coef > 0 and Path(student.distill.teacher_path) == last / "hf"
    baseline, _ = load_config(
        ["--config", str(folder / "student.yaml"), "distill.coef=0", "distill.teacher_path=null"]
    )
    assert baseline.distill.coef == 0 and baseline.distill.teacher_path is None


def test_agent_grpo_starts_from_the_warm_up_example_writes():
    """examples/agent: config.yaml starts from the HF export of sft.yaml's last step."""
    folder = ROOT / "examples" / "agent"
    warm_up, _ = load_config(["--config", str(folder / "sft.yaml")])
    grpo, _ = load_config(["--config", str(folder / "config.yaml")])
    last = step_path(checkpoint_dir(warm_up), warm_up.num_steps)
    assert warm_up.checkpoint.save_hf and warm_up.num_steps % warm_up.checkpoint.interval == 0
    assert Path(grpo.model.path) == last / "hf"
