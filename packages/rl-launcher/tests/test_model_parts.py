"""examples/smollm2/model_parts.py: a file split into parts, carried one part per call and
joined, comes back byte for byte; a damaged piece is refused and nothing is written."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "examples/smollm2/model_parts.py"


def parts(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_split_then_join_one_part_per_call(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(bytes(range(256)) * 10_000)  # 2.44 MiB: three 1-MiB parts
    split = parts("split", str(source), str(tmp_path / "parts"), "--part-mib", "1")
    assert split.returncode == 0, split.stderr
    folders = sorted((tmp_path / "parts").iterdir())
    assert [f.name for f in folders] == ["part_000", "part_001", "part_002"]
    output, stash = tmp_path / "out/model.gguf", tmp_path / "stash"
    for i, folder in enumerate(folders):
        joined = parts("join", str(folder), "--stash", str(stash), "--output", str(output))
        assert joined.returncode == 0, joined.stderr
        assert output.exists() == (i == 2), joined.stdout  # only the last call assembles
    assert output.read_bytes() == source.read_bytes()
    assert output.stat().st_mode & 0o777 == 0o644


def test_a_damaged_piece_is_refused_and_nothing_written(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"x" * (3 << 20))
    assert parts("split", str(source), str(tmp_path / "parts"), "--part-mib", "2").returncode == 0
    first, second = sorted((tmp_path / "parts").iterdir())
    piece = second / "model.gguf.001"
    piece.write_bytes(piece.read_bytes()[:-1] + b"y")
    output, stash = tmp_path / "model.gguf.out", tmp_path / "stash"
    assert parts("join", str(first), "--stash", str(stash), "--output", str(output)).returncode == 0
    joined = parts("join", str(second), "--stash", str(stash), "--output", str(output))
    assert joined.returncode == 1 and "model.gguf.001: SHA-256 differs" in joined.stderr
    assert not output.exists() and not list(tmp_path.glob(".model.gguf.out.*"))
    assert (
        parts("join", str(tmp_path), "--stash", str(stash), "--output", str(output)).returncode == 2
    )  # not a part folder
