"""``rl-rewards`` command line: ``score`` a JSONL/Parquet file of predictions, ``list`` rewards.

    rl-rewards score --reward math --input preds.jsonl --output scored.jsonl \\
        [--response-key response --label-key label --group-key prompt_id --k 1,4,8 --workers N]
    rl-rewards list
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rl_rewards.batch import ScoreResult, score_batch
from rl_rewards.metrics import summarize_scores
from rl_rewards.registry import get_reward, list_rewards
from rl_rewards.rows import Row, check_format_available, read_rows, write_rows_atomic


class ProgressBar:
    """A one-line progress bar on stderr, redrawn at most every 0.2 s."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled, self.last_draw = total, 0, enabled, 0.0

    def update(self, index: int, result: ScoreResult) -> None:
        self.done += 1
        now = time.monotonic()
        if self.enabled and (now - self.last_draw > 0.2 or self.done == self.total):
            self.last_draw = now
            filled = int(30 * self.done / max(self.total, 1))
            bar = "#" * filled + "." * (30 - filled)
            print(f"\r[{bar}] {self.done}/{self.total}", end="", file=sys.stderr, flush=True)
            if self.done == self.total:
                print(file=sys.stderr)


def _parse_ks(text: str) -> list[int]:
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError as exc:
        raise ValueError(f"--k must be comma-separated integers like 1,4,8; got {text!r}") from exc
    if not ks or min(ks) < 1:
        raise ValueError(f"--k values must be >= 1; got {text!r}")
    return ks


def _check_first_row(row: dict[str, Any], keys: list[str]) -> None:
    missing = [key for key in keys if key not in row]
    if missing:
        raise ValueError(
            f"the first row has no field(s) {missing}; its fields are {sorted(row)} "
            "(pick them with --response-key / --label-key / --group-key)"
        )


def _split_rows(rows: list[Row], keys: list[str]) -> tuple[list[Row], list[str]]:
    """Usable rows, and one message per malformed row ("line N: why")."""
    good, problems = [], []
    for row in rows:
        if row.data is not None and not good:
            _check_first_row(row.data, keys)
        missing = [k for k in keys if row.data is not None and k not in row.data]
        if row.data is None or missing:
            problems.append(f"line {row.line}: {row.error or f'missing field(s) {missing}'}")
        else:
            good.append(row)
    return good, problems


def cmd_score(args: argparse.Namespace) -> dict[str, Any]:
    options = json.loads(args.options) if args.options else {}
    get_reward(args.reward, **options)  # fail fast on an unknown name
    check_format_available(args.output)
    keys = [args.response_key, args.label_key] + ([args.group_key] if args.group_key else [])
    good, problems = _split_rows(list(read_rows(args.input)), keys)
    for problem in problems:
        print(f"skipped malformed row: {problem}", file=sys.stderr)
    responses = [str(row.data[args.response_key]) for row in good]
    labels = [row.data[args.label_key] for row in good]
    progress = ProgressBar(len(good), enabled=not args.quiet)
    report = score_batch(
        args.reward, responses, labels, options=options, workers=args.workers,
        timeout_s=args.timeout, on_result=progress.update,
    )  # fmt: skip
    out_rows = [
        {**row.data, "score": r.score, "reward_status": r.status, "reward_reason": r.reason}
        for row, r in zip(good, report.results, strict=True)
    ]
    write_rows_atomic(args.output, out_rows)
    groups = [json.dumps(row.data[args.group_key]) for row in good] if args.group_key else None
    summary = summarize_scores(
        report.scores, [r.status for r in report.results], group_ids=groups,
        ks=_parse_ks(args.k), threshold=args.threshold,
    )  # fmt: skip
    return {"reward": args.reward, "num_malformed": len(problems), **summary}


def cmd_list(args: argparse.Namespace) -> None:
    specs = list_rewards()
    width = max(len(spec.name) for spec in specs)
    for spec in specs:
        print(f"{spec.name:<{width}}  {spec.description}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rl-rewards", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    score = commands.add_parser("score", help="score a JSONL or Parquet file of predictions")
    score.add_argument("--reward", required=True, help="registered name or pkg.module:function")
    score.add_argument("--input", required=True)
    score.add_argument("--output", required=True, help=".jsonl, or .parquet with pyarrow")
    score.add_argument("--response-key", default="response")
    score.add_argument("--label-key", default="label")
    score.add_argument("--group-key", default=None, help="field grouping samples for pass@k")
    score.add_argument("--k", default="1", help="pass@k values, e.g. 1,4,8")
    score.add_argument("--threshold", type=float, default=1.0, help="score counted as correct")
    score.add_argument("--workers", type=int, default=0, help="processes (0: in this one)")
    score.add_argument("--timeout", type=float, default=10.0, help="seconds per sample")
    score.add_argument("--options", default=None, help="JSON object of reward keyword options")
    score.add_argument("--quiet", action="store_true", help="no progress bar")
    commands.add_parser("list", help="list the registered rewards")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "list":
            cmd_list(args)
        else:
            print(json.dumps(cmd_score(args), indent=2))
    except (ValueError, FileNotFoundError) as exc:
        print(f"rl-rewards: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
