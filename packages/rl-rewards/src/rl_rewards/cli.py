"""``rl-rewards`` command line: ``score`` a JSONL/Parquet file of predictions, ``list`` rewards.

    rl-rewards score --reward math --input preds.jsonl --output scored.jsonl \\
        [--response-key response --label-key label --group-key prompt_id --k 1,4,8 --workers N]
    rl-rewards list

Every argument is checked before anything is read, scored or written (exit status 2 with
one line naming the option); the output file is replaced atomically with the usual
permissions. An input with no usable row is an error, not a mean of 0.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import tempfile
import time
from pathlib import Path
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


def _parse_options(text: str | None, reward: str) -> dict[str, Any]:
    """``--options`` as keyword arguments ``reward`` accepts (ValueError naming --options);
    an unknown ``reward`` fails here too, listing the valid names."""
    fn = get_reward(reward)
    if text is None:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"--options is not valid JSON ({exc.msg} at column {exc.colno}): {text!r}; "
            """give an object such as '{"strict_box": true}'"""
        ) from exc
    if not isinstance(options, dict):
        raise ValueError(
            f"--options must be a JSON object of keyword options, got {type(options).__name__}"
        )
    try:
        inspect.signature(fn).bind_partial(None, None, **options)
    except TypeError as exc:
        raise ValueError(f"--options does not fit reward {reward!r}: {exc}") from exc
    return options


def _check_input(path: Path) -> None:
    if path.is_dir():
        raise ValueError(f"--input {str(path)!r} is a directory; give a JSONL or Parquet file")
    if not path.is_file():
        raise ValueError(f"--input {str(path)!r}: no such file")
    check_format_available(path)


def _check_output(path: Path) -> None:
    """ValueError now, before any scoring, when ``path`` cannot be written: a directory, a
    file as its folder, or a folder (its first existing one) where no file can be made (a
    real attempt: permissions, a read-only file system, root included)."""
    if path.is_dir():
        raise ValueError(f"--output {str(path)!r} is a directory; give a file name in it")
    check_format_available(path)
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--output {str(path)!r}: {str(parent)!r} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise ValueError(
            f"--output {str(path)!r}: cannot write in {str(parent)!r} ({exc.strerror})"
        ) from exc


def check_score_args(args: argparse.Namespace) -> tuple[dict[str, Any], list[int]]:
    """Every ``score`` argument checked before anything is read, scored or written;
    returns the reward options and the pass@k values."""
    if args.k is not None and not args.group_key:
        raise ValueError("--k needs --group-key (pass@k is taken over each group's samples)")
    ks = _parse_ks(args.k or "1")
    if args.workers < 0:
        raise ValueError(f"--workers must be >= 0 (0 scores in this process), got {args.workers}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    if not math.isfinite(args.threshold):
        raise ValueError(f"--threshold must be a finite number, got {args.threshold}")
    options = _parse_options(args.options, args.reward)
    _check_input(Path(args.input))
    _check_output(Path(args.output))
    return options, ks


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
    options, ks = check_score_args(args)
    keys = [args.response_key, args.label_key] + ([args.group_key] if args.group_key else [])
    good, problems = _split_rows(list(read_rows(args.input)), keys)
    for problem in problems:
        print(f"skipped malformed row: {problem}", file=sys.stderr)
    if not good:
        what = f"all {len(problems)} rows are malformed" if problems else "the file is empty"
        raise ValueError(f"--input {args.input!r} has no rows to score ({what}); nothing written")
    responses = [str(row.data[args.response_key]) for row in good]
    labels = [row.data[args.label_key] for row in good]
    progress = ProgressBar(len(good), enabled=not args.quiet)
    report = score_batch(
        args.reward,
        responses,
        labels,
        options=options,
        workers=args.workers,
        timeout_s=args.timeout,
        on_result=progress.update,
    )
    out_rows = [
        {**row.data, "score": r.score, "reward_status": r.status, "reward_reason": r.reason}
        for row, r in zip(good, report.results, strict=True)
    ]
    write_rows_atomic(args.output, out_rows)
    groups = [json.dumps(row.data[args.group_key]) for row in good] if args.group_key else None
    summary = summarize_scores(
        report.scores,
        [r.status for r in report.results],
        group_ids=groups,
        ks=ks,
        threshold=args.threshold,
    )
    return {"reward": args.reward, "num_malformed": len(problems), **summary}


def cmd_list(args: argparse.Namespace) -> None:
    specs = list_rewards()
    width = max(len(spec.name) for spec in specs)
    for spec in specs:
        print(f"{spec.name:<{width}}  {spec.description}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rl-rewards", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    score = commands.add_parser(
        "score",
        help="score a JSONL or Parquet file of predictions",
        description="Score each row's response against its label; write the rows with "
        "score, reward_status and reward_reason added; print a JSON summary (mean, errors, "
        "timeouts, pass@k with --group-key). Exit status 0, or 2 on bad input.",
    )
    score.add_argument(
        "--reward",
        required=True,
        help="registered name (see: rl-rewards list) or pkg.module:function",
    )
    score.add_argument("--input", required=True, help="a .jsonl file, or .parquet with pyarrow")
    score.add_argument(
        "--output", required=True, help=".jsonl, or .parquet with pyarrow; replaced atomically"
    )
    score.add_argument(
        "--response-key",
        default="response",
        help="field holding the response (default: %(default)s)",
    )
    score.add_argument(
        "--label-key", default="label", help="field holding the label (default: %(default)s)"
    )
    score.add_argument(
        "--group-key",
        default=None,
        help="field grouping the samples of one prompt, for pass@k (default: none)",
    )
    score.add_argument(
        "--k", default=None, help="pass@k values, e.g. 1,4,8; needs --group-key (default: 1)"
    )
    score.add_argument(
        "--threshold",
        type=float,
        default=1.0,
        help="a score at least this is correct (default: %(default)s)",
    )
    score.add_argument(
        "--workers",
        type=int,
        default=0,
        help="reward processes; 0 scores in this one (default: %(default)s)",
    )
    score.add_argument(
        "--timeout", type=float, default=10.0, help="seconds per sample (default: %(default)s)"
    )
    score.add_argument(
        "--options",
        default=None,
        help="""JSON object of the reward's keyword options, e.g. '{"strict_box": """
        """true}' (default: none)""",
    )
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
    except (ValueError, OSError) as exc:  # bad input, or a file that cannot be read or written
        print(f"rl-rewards: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
