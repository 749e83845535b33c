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
    code = main(["score", "--reward", "math", "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(out), "--group-key", "q", "--k", "1,2", "--quiet"])  # fmt: skip
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
    code = main(["score", "--reward", "math", "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(out), "--label-key", "answer"])  # fmt: skip
    assert code == 2
    assert "fields are ['label', 'q', 'response']" in capsys.readouterr().err
    assert out.read_text() == "previous\n"


def test_unknown_reward_lists_valid_names(tmp_path, capsys):
    _write_jsonl(tmp_path / "in.jsonl", ROWS)
    code = main(["score", "--reward", "maths", "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "o.jsonl")])  # fmt: skip
    assert code == 2 and "valid names" in capsys.readouterr().err


def test_parquet_round_trip_with_options(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "in.parquet")
    code = main(["score", "--reward", "math", "--input", str(tmp_path / "in.parquet"),
                 "--output", str(tmp_path / "out.parquet"), "--options", '{"strict_box": true}',
                 "--quiet"])  # fmt: skip
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
        [sys.executable, "-m", "rl_rewards.cli", "score", "--reward", "math", "--input",
         str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"), "--workers", "2"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(scored.stdout)["mean"] == 0.75
    assert "4/4" in scored.stderr  # the progress bar
