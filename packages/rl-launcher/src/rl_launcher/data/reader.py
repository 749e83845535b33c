"""Stream rows out of JSONL and Parquet files, with ``path@[a:b]`` row slicing.

Rows are numbered from 0 in file order (blank JSONL lines are not rows); ``@[a:b]`` keeps
rows a..b-1 with Python slice semantics (negative bounds count from the end). Parquet is
read one record batch at a time, JSONL one line at a time, so large files never sit in
memory whole. A row that does not parse is yielded with its error, not raised, so the
caller decides (skip and count, or stop).
"""

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SLICE = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


@dataclass(frozen=True)
class RawRow:
    """One row: its index among rows, where it is for people (``file:line``), and either
    the parsed value or the reason it could not be parsed."""

    index: int
    where: str
    value: Any = None
    error: str | None = None


def parse_spec(spec: str) -> tuple[Path, int | None, int | None]:
    """``"data.jsonl@[10:-5]"`` -> ``(Path("data.jsonl"), 10, -5)``; no slice -> Nones."""
    match = _SLICE.match(spec)
    if match is None:
        if "@[" in spec:
            raise ValueError(
                f"bad dataset slice in {spec!r}; write path@[start:stop], e.g. a.jsonl@[0:100]"
            )
        return Path(spec), None, None
    start, stop = match["start"], match["stop"]
    return Path(match["path"]), int(start) if start else None, int(stop) if stop else None


def check_exists(spec: str) -> Path:
    """The file named by ``spec``; ValueError naming it when there is none."""
    path = parse_spec(spec)[0]
    if not path.is_file():
        raise ValueError(f"dataset {str(path)!r} does not exist (from data path {spec!r})")
    return path


def iter_rows(spec: str, *, batch_rows: int = 1024) -> Iterator[RawRow]:
    """Rows of the file named by ``spec`` (sliced when it says so), streamed."""
    path, start, stop = check_exists(spec), *parse_spec(spec)[1:]
    if start is None and stop is None:
        yield from _iter_file(path, batch_rows)
        return
    begin, end, _ = slice(start, stop).indices(
        count_rows(path) if _negative(start, stop) else 2**62
    )
    for row in _iter_file(path, batch_rows):
        if row.index >= end:
            return
        if row.index >= begin:
            yield row


def _negative(start: int | None, stop: int | None) -> bool:
    return (start is not None and start < 0) or (stop is not None and stop < 0)


def count_rows(path: Path) -> int:
    if path.suffix in PARQUET_SUFFIXES:
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with path.open("rb") as handle:
        return sum(1 for line in handle if line.strip())


def _iter_file(path: Path, batch_rows: int) -> Iterator[RawRow]:
    if path.suffix in PARQUET_SUFFIXES:
        return _iter_parquet(path, batch_rows)
    if path.suffix in JSONL_SUFFIXES:
        return _iter_jsonl(path)
    raise ValueError(
        f"dataset {str(path)!r}: unknown format {path.suffix!r}; use one of "
        f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}"
    )


def _iter_jsonl(path: Path) -> Iterator[RawRow]:
    index = 0
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                yield RawRow(index, where, value=json.loads(line))
            except json.JSONDecodeError as error:
                yield RawRow(
                    index, where, error=f"invalid JSON ({error.msg} at column {error.colno})"
                )
            index += 1


def _iter_parquet(path: Path, batch_rows: int) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
        for value in batch.to_pylist():
            yield RawRow(index, f"{path} row {index}", value=value)
            index += 1
