"""The prompts each step trained on, in ``<run_dir>/data_order.jsonl``:

    {"step": 3, "prompts": ["train:17", "train:4", ...], "draws": [8, 9, ...]}

``prompts`` are ``dataset:row`` ids of the step's groups in draw order, ``draws`` their
draw numbers in the prompt stream. A resumed run drops the records after its checkpoint
(they are redone), so the file of a killed-and-resumed run reads like an uninterrupted one.
"""

import json
import os
from pathlib import Path

DATA_ORDER_FILE = "data_order.jsonl"


def prompt_id(sample) -> str:
    return f"{sample.metadata.get('dataset', '?')}:{sample.metadata.get('row', '?')}"


def append(run_dir: str | Path, step: int, groups: list[list]) -> None:
    record = {
        "step": step,
        "prompts": [prompt_id(g[0]) for g in groups],
        "draws": [g[0].group_index for g in groups],
    }
    with open(Path(run_dir) / DATA_ORDER_FILE, "a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")


def read(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / DATA_ORDER_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a run killed mid-write leaves a torn last line
            break
    return records


def truncate(run_dir: str | Path, last_step: int) -> None:
    """Keep the records of steps up to ``last_step`` (atomic rewrite)."""
    path = Path(run_dir) / DATA_ORDER_FILE
    if not path.is_file():
        return
    kept = [r for r in read(run_dir) if r["step"] <= last_step]
    tmp = path.with_name(DATA_ORDER_FILE + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)
