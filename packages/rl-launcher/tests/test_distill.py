"""On-policy distillation (``distill.*``): the buffer's shaped advantages by hand, the
config checks, and rl-train with an embedded teacher engine end to end."""

import math
from pathlib import Path

import pytest
import torch

from rl_core.types import Sample
from rl_launcher.config.loader import load_config
from rl_launcher.data.buffer import TEACHER_KEY, DataBuffer

A = 0.5 / (math.sqrt(0.5) + 1e-6)  # GRPO advantage of a {1, 0} pair
ROOT = Path(__file__).resolve().parents[3]


def scored(group, index, tokens, reward, student, teacher, loss_mask=None):
    return Sample(
        tokens=tokens,
        response_length=len(student),
        reward=reward,
        group_index=group,
        index=index,
        rollout_log_probs=student,
        loss_mask=loss_mask,
        metadata={TEACHER_KEY: teacher},
    )


def test_advantages_lose_coef_times_student_minus_teacher_on_trained_tokens():
    buffer = DataBuffer(group_size=2, num_ranks=1, opd_coef=0.5)
    buffer.add(
        [
            scored(0, 0, [1, 2, 3, 4], 1.0, [-1.0, -2.0], [-1.5, -0.5]),
            scored(0, 1, [1, 2, 5], 0.0, [-0.25], [-0.25]),  # teacher agrees: the GRPO value alone
            scored(1, 0, [7, 8, 9, 9], 1.0, [-3.0, -1.0, -2.0], [-1.0, -9.0, -2.5], [1, 0, 1]),
            scored(1, 1, [7, 8, 4], 1.0, [-0.5], [-4.5]),  # equal rewards: distillation alone
        ]
    )
    step = buffer.pop_step(2)
    # response token j of a sample with prompt length P is predicted at position P - 1 + j
    expected = [
        0,
        A - 0.5 * 0.5,
        A - 0.5 * -1.5,
        0,  # [1, 2 | 3, 4]
        0,
        -A,
        0,  # [1, 2 | 5]: the teacher agrees, the GRPO value alone
        -0.5 * -2.0,
        0,
        -0.5 * 0.5,
        0,  # [7 | 8, 9, 9]: the tool token 9 (mask 0) gets none
        0,
        -0.5 * 4.0,
        0,  # [7, 8 | 4]
    ]
    torch.testing.assert_close(step.rank_batches[0].advantages, torch.tensor(expected))
    reverse_kl = [0.5, -1.5, 0.0, -2.0, 0.5, 4.0]  # over the 6 trained tokens
    assert step.metrics["opd/reverse_kl"] == pytest.approx(sum(reverse_kl) / 6)


def test_coef_zero_leaves_the_estimators_advantages_and_adds_no_metric():
    samples = [
        scored(0, 0, [1, 2, 3], 1.0, [-1.0], [-9.0]),
        scored(0, 1, [1, 2, 4], 0.0, [-1.0], [0.0]),
    ]
    buffer = DataBuffer(group_size=2, num_ranks=1)
    buffer.add(samples)
    step = buffer.pop_step(1)
    torch.testing.assert_close(step.rank_batches[0].advantages, torch.tensor([0, A, 0, 0, -A, 0]))
    assert not any(key.startswith("opd/") for key in step.metrics)


@pytest.mark.parametrize(
    "estimator, whiten",
    [("reinforce_plus_plus_baseline", None), ("dr_grpo", True)],  # whitened by default, asked
)
def test_whitening_comes_after_the_teacher_term_as_in_slime(estimator, whiten):
    buffer = DataBuffer(
        group_size=2, num_ranks=1, advantage_estimator=estimator, opd_coef=1.0, whiten=whiten
    )
    buffer.add(
        [
            scored(0, 0, [1, 2, 3], 1.0, [-1.0], [-1.0]),
            scored(0, 1, [1, 2, 4], 0.0, [-1.0], [-3.0]),
        ]
    )
    step = buffer.pop_step(1)
    # centred rewards 0.5, -0.5 minus reverse KL 0, 2: 0.5, -2.5; whitened: +-1/sqrt(2)
    # (whitening first, then the term, would give 0.71, -2.71)
    w = 1 / math.sqrt(2)
    torch.testing.assert_close(
        step.rank_batches[0].advantages, torch.tensor([0, w, 0, 0, -w, 0]), atol=1e-6, rtol=0
    )


def test_a_sample_without_teacher_log_probs_is_refused_by_name():
    buffer = DataBuffer(
        group_size=1, num_ranks=1, advantage_estimator="reinforce_plus_plus", opd_coef=1.0
    )
    buffer.add(
        [
            Sample(
                tokens=[1, 2],
                response_length=1,
                reward=1.0,
                group_index=3,
                index=0,
                rollout_log_probs=[-1.0],
            )
        ]
    )
    with pytest.raises(ValueError, match=r"sample 3/0 lacks .*teacher_log_probs"):
        buffer.pop_step(1)


QUICKSTART = [
    "--config",
    str(ROOT / "examples/quickstart/config.yaml"),
    "--model.tokenizer_path",
    str(ROOT / "examples/quickstart/tokenizer"),
    "--data.train.0.path",
    str(ROOT / "examples/quickstart/data/train.jsonl"),
]


@pytest.mark.parametrize(
    "options, message",
    [
        (["--distill.coef", "1"], "needs one teacher: .* not neither"),
        (
            [
                "--distill.coef",
                "1",
                "--distill.teacher_url",
                "http://127.0.0.1:1",
                "--distill.teacher_path",
                "/x",
            ],
            "not both",
        ),
        (["--distill.teacher_url", "http://127.0.0.1:1"], "distill.coef=0, so the teacher"),
        (
            ["--distill.coef", "1", "--distill.teacher_url", "http://h:1", "--mode", "sft"],
            "mode=rl without rollout.rollout_only",
        ),
        (
            [
                "--distill.coef",
                "1",
                "--distill.teacher_url",
                "http://h:1",
                "--rollout.rollout_only",
                "true",
            ],
            "mode=rl without rollout.rollout_only",
        ),
    ],
)
def test_config_refuses_a_distillation_without_exactly_one_usable_teacher(options, message):
    with pytest.raises(ValueError, match=message):
        load_config([*QUICKSTART, *options])


def test_a_teacher_path_without_a_model_is_refused_before_anything_starts(tmp_path):
    from rl_launcher.session.run import check_teacher

    argv = [*QUICKSTART, "--distill.coef", "1", "--distill.teacher_path", str(tmp_path)]
    config, _ = load_config(argv)  # a later run may write it: the config alone is fine
    with pytest.raises(ValueError, match=r"has no config\.json"):
        check_teacher(config)
    (tmp_path / "config.json").write_text("{}")
    check_teacher(config)


@pytest.mark.integration
def test_rl_train_distils_from_an_embedded_teacher(tmp_path):
    """Two steps with a teacher engine started from a local directory: the dumped samples
    carry the teacher's teacher-forced log-probs, and each step's opd/reverse_kl is their
    mean gap to the rollout log-probs."""
    from transformers import AutoModelForCausalLM

    from rl_launcher.cli import main
    from rl_launcher.infra.dumps import dump_files, read_rollout
    from rl_launcher.infra.run_log import read_metrics
    from rl_launcher.session.model import prepare_model

    config, _ = load_config(QUICKSTART)
    teacher_dir, _ = prepare_model(config.model, run_dir=tmp_path / "teacher", seed=7)
    run_dir = tmp_path / "run"
    argv = [
        *QUICKSTART,
        "--num_steps",
        "2",
        "--rollout.batch_size",
        "4",
        "--rollout.group_size",
        "4",
        "--logging.run_dir",
        str(run_dir),
        "--rollout.dump_dir",
        str(tmp_path / "dumps"),
        "--checkpoint.interval",
        "0",
        "--distill.coef",
        "0.5",
        "--distill.teacher_path",
        str(teacher_dir),
    ]
    assert main(argv) == 0
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    records = [r for r in read_metrics(run_dir) if "opd/reverse_kl" in r]
    assert [r["step"] for r in records] == [1, 2]
    for record, path in zip(records, dump_files(tmp_path / "dumps"), strict=True):
        samples = [s for group in read_rollout(path) for s in group]
        gaps = []
        for s in samples:
            with torch.no_grad():
                logits = teacher(torch.tensor([s.tokens])).logits[0].float()
            logprobs = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(s.tokens[1:])[:, None])
            expected = logprobs[-s.response_length :, 0].tolist()
            assert s.metadata[TEACHER_KEY] == pytest.approx(expected, abs=1e-4)
            gaps += [a - b for a, b in zip(s.rollout_log_probs, expected, strict=True)]
        assert math.isfinite(record["opd/reverse_kl"]) and record["time/teacher"] > 0
        assert record["opd/reverse_kl"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-4)
        # two different models: a real gap per token (the signed mean above may cancel out)
        assert sum(abs(g) for g in gaps) / len(gaps) > 1e-3
