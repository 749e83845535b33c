"""The rl-rewards CLI: scoring a JSONL/Parquet file, malformed rows, atomic output, pass@k."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_rewards.cli import main

ROWS = [
    {"q": 1, "response": "\\boxed{2}", "label": "2"},
    {"q": 1, "response": "\\boxed{3}", "label": "2"},
    {"q": 2, "response": "\\boxed{5}", "label": "5"},
    {"q": 2, "response": "\\boxed{5}", "label": "5"},
]


def _write_jsonl(path, rows, extra_lines=()):
    lines = [json.dumps(r) for r in rows] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")


def test_score_writes_rows_and_prints_summary(tmp_path, capsys):
    _write_jsonl(tmp_path / "in.jsonl", ROWS, ["{broken", "[1, 2]", json.dumps({"label": "1"})])
    out = tmp_path / "sub" / "out.jsonl"
    code = main(
        [
            "score",
            "--reward",
            "math",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(out),
            "--group-key",
            "q",
            "--k",
            "1,2",
            "--quiet",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0
    summary = json.loads(captured.out)
    assert summary["num_scored"] == 4 and summary["num_malformed"] == 3
    assert summary["mean"] == 0.75
    assert summary["pass@1"] == pytest.approx((0.5 + 1.0) / 2)
    assert summary["pass@2"] == 1.0
    assert (
        "line 5: invalid JSON" in captured.err and "line 6: expected a JSON object" in captured.err
    )
    assert "line 7: missing field(s) ['response', 'q']" in captured.err
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["score"] for r in written] == [1.0, 0.0, 1.0, 1.0]
    assert written[0]["reward_status"] == "ok" and written[0]["q"] == 1
    assert os.listdir(out.parent) == ["out.jsonl"]  # no temporary file left behind


def test_missing_label_field_is_a_clear_error_and_leaves_output_alone(tmp_path, capsys):
    _write_jsonl(tmp_path / "in.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")
    code = main(
        [
            "score",
            "--reward",
            "math",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(out),
            "--label-key",
            "answer",
        ]
    )
    assert code == 2
    assert "fields are ['label', 'q', 'response']" in capsys.readouterr().err
    assert out.read_text() == "previous\n"


def test_unknown_reward_lists_valid_names(tmp_path, capsys):
    _write_jsonl(tmp_path / "in.jsonl", ROWS)
    code = main(
        [
            "score",
            "--reward",
            "maths",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "o.jsonl"),
        ]
    )
    assert code == 2 and "valid names" in capsys.readouterr().err


def test_parquet_round_trip_with_options(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "in.parquet")
    code = main(
        [
            "score",
            "--reward",
            "math",
            "--input",
            str(tmp_path / "in.parquet"),
            "--output",
            str(tmp_path / "out.parquet"),
            "--options",
            '{"strict_box": true}',
            "--quiet",
        ]
    )
    assert code == 0
    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["score"] for r in table] == [1.0, 0.0, 1.0, 1.0]


@pytest.mark.integration
def test_console_script_list_and_score_with_workers(tmp_path):
    script = Path(sys.executable).with_name("rl-rewards")  # the installed console script
    assert script.exists()
    listed = subprocess.run([str(script), "list"], capture_output=True, text=True, check=True)
    names = [line.split()[0] for line in listed.stdout.splitlines()]
    assert "math" in names and "code" in names and names == sorted(names)
    _write_jsonl(tmp_path / "in.jsonl", ROWS)
    scored = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl_rewards.cli",
            "score",
            "--reward",
            "math",
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "o.jsonl"),
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(scored.stdout)["mean"] == 0.75
    assert "4/4" in scored.stderr  # the progress bar


def _run_cli(*args, umask=None):
    """``python -m rl_rewards.cli ARGS`` in a fresh process (what a user's shell runs)."""
    return subprocess.run(
        [sys.executable, "-m", "rl_rewards.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=(lambda: os.umask(umask)) if umask is not None else None,
    )


def test_score_help_shows_the_defaults():
    shown = _run_cli("score", "--help")
    assert shown.returncode == 0
    text = " ".join(shown.stdout.split())
    for default in (
        "(default: response)",
        "(default: label)",
        "(default: 1)",
        "(default: 1.0)",
        "(default: 0)",
        "(default: 10.0)",
    ):
        assert default in text, default


BAD_SCORE_ARGS = {  # case -> (what to change, words the one-line error must hold)
    "input is a directory": ({"--input": "{dir}"}, "--input", "is a directory"),
    "input missing": ({"--input": "{dir}/nope.jsonl"}, "--input", "no such file"),
    "output is a directory": ({"--output": "{dir}"}, "--output", "is a directory"),
    "output under a file": (
        {"--output": "{dir}/in.jsonl/out.jsonl"},
        "--output",
        "is not a directory",
    ),
    "output unwritable": (
        {"--output": "/proc/rl-rewards-test/out.jsonl"},
        "--output",
        "cannot write in '/proc'",
    ),
    "--k without --group-key": ({"--k": "1,2"}, "--k", "--group-key"),
    "--k not numbers": ({"--k": "one", "--group-key": "q"}, "--k", "integers"),
    "--options not JSON": ({"--options": "{strict_box: true"}, "--options", "not valid JSON"),
    "--options a list": ({"--options": "[1]"}, "--options", "JSON object"),
    "--options unknown keyword": ({"--options": '{"nope": 1}'}, "--options", "'nope'"),
    "--workers negative": ({"--workers": "-1"}, "--workers", ">= 0"),
    "--timeout zero": ({"--timeout": "0"}, "--timeout", "> 0"),
    "--threshold nan": ({"--threshold": "nan"}, "--threshold", "finite"),
}


@pytest.mark.parametrize("case", BAD_SCORE_ARGS)
def test_every_argument_is_checked_before_scoring_or_writing(tmp_path, case):
    """Each bad argument: exit 2, one stderr line naming the option (no traceback), nothing
    printed and no output file (before, --k was parsed after the output was written)."""
    changes, option, words = BAD_SCORE_ARGS[case]
    _write_jsonl(tmp_path / "in.jsonl", ROWS)
    args = {
        "--reward": "math",
        "--input": tmp_path / "in.jsonl",
        "--output": tmp_path / "out.jsonl",
    }
    args |= {name: value.replace("{dir}", str(tmp_path)) for name, value in changes.items()}
    result = _run_cli("score", *(item for pair in args.items() for item in pair), "--quiet")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rl-rewards: error: "), result.stderr
    assert option in lines[0] and words in lines[0], lines[0]
    assert result.stdout == "" and not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    ("content", "words"),
    [("", "the file is empty"), ("{broken\n[1]\n", "all 2 rows are malformed")],
)
def test_an_input_with_nothing_to_score_is_reported_as_such(tmp_path, content, words):
    (tmp_path / "in.jsonl").write_text(content)
    result = _run_cli(
        "score",
        "--reward",
        "math",
        "--input",
        tmp_path / "in.jsonl",
        "--output",
        tmp_path / "out.jsonl",
    )
    assert result.returncode == 2 and "mean" not in result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rl-rewards: error: --input") and "no rows to score" in last
    assert words in last and not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_the_output_file_gets_the_usual_permissions(tmp_path, suffix):
    """The atomic write's temporary file is made 0600; the output follows the umask like
    any file the user's shell makes (0644 under umask 022, 0660 under 007)."""
    _write_jsonl(tmp_path / "in.jsonl", ROWS)
    for umask, mode in ((0o022, 0o644), (0o007, 0o660)):
        out = tmp_path / f"out_{umask:o}.{suffix}"
        result = _run_cli(
            "score",
            "--reward",
            "math",
            "--input",
            tmp_path / "in.jsonl",
            "--output",
            out,
            "--quiet",
            umask=umask,
        )
        assert result.returncode == 0, result.stderr
        assert out.stat().st_mode & 0o777 == mode
