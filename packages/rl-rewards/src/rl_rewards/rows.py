"""Reading and writing row files for the CLI: JSONL always, Parquet when pyarrow is installed.

Writes are atomic: a temporary file in the destination folder, then ``os.replace``; the
file gets the permissions a plain ``open`` would give it (0666 less the umask), not the
temporary file's 0600.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Row:
    """One input row (``data``) or a malformed one (``error`` set); ``line`` is 1-based."""

    line: int
    data: dict[str, Any] | None
    error: str = ""


def _require_pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ValueError(
            "Parquet files need pyarrow: pip install 'rl-rewards[parquet]' (or use JSONL)"
        ) from exc
    return pq


def _is_parquet(path: Path) -> bool:
    return path.suffix.lower() in (".parquet", ".pq")


def check_format_available(path: str | Path) -> None:
    """ValueError now (before any scoring) if ``path`` is Parquet and pyarrow is missing."""
    if _is_parquet(Path(path)):
        _require_pyarrow()


def read_rows(path: str | Path) -> Iterator[Row]:
    """Rows of a JSONL or Parquet file; a JSONL line that is not a JSON object is malformed."""
    path = Path(path)
    if _is_parquet(path):
        table = _require_pyarrow().read_table(path)
        for line, data in enumerate(table.to_pylist(), start=1):
            yield Row(line, data)
        return
    with path.open(encoding="utf-8") as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                yield Row(line, None, f"invalid JSON: {exc.msg} (column {exc.colno})")
                continue
            if isinstance(data, dict):
                yield Row(line, data)
            else:
                yield Row(line, None, f"expected a JSON object, got {type(data).__name__}")


def write_rows_atomic(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` to ``path`` (JSONL or Parquet by suffix) via a temp file + os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(temp_name, 0o666 & ~current_umask())
        if _is_parquet(path):
            os.close(fd)
            pq = _require_pyarrow()
            pq.write_table(_table(rows), temp_name)
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                for row in rows:
                    handle.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    """This process's umask (read by setting it and putting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _table(rows: list[dict[str, Any]]):
    import pyarrow

    return pyarrow.Table.from_pylist(rows)
