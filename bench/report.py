"""Writing a benchmark's JSON report: to a temporary file, then renamed over the target,
so a run killed mid-write (a time limit) never leaves a truncated report."""

import json
import os
from pathlib import Path


def write_report(report: dict, path: str | Path, *, indent: int = 2) -> None:
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=indent))
    os.replace(tmp, path)
