"""``rl-plot``: PNG charts of a run's metrics.jsonl, written to ``<run_dir>/plots/``.

Charts (each written when its metrics exist): reward, eval pass@k, KL, entropy, response
length and the step-time split (:func:`time_split`). Rendering uses matplotlib's Agg canvas
directly (no pyplot, no display needed).
"""

from pathlib import Path
from typing import Any

from rl_launcher.infra.run_log import read_metrics

LINE_CHARTS = {
    "reward": ("rollout/reward/mean", "mean training reward"),
    "sft_loss": ("loss/sft", "SFT loss (negative log-likelihood per token)"),
    "value_loss": ("loss/value", "critic value loss"),
    "kl": ("train/kl", "KL to reference"),
    "entropy": ("train/entropy", "policy entropy"),
    "response_length": ("rollout/response_length/mean", "mean response length (tokens)"),
}

Series = dict[str, tuple[list[int], list[float]]]


def series(records: list[dict[str, Any]], keys: list[str]) -> Series:
    """``{key: (steps, values)}`` of the records that have a number under ``key``."""
    out: Series = {}
    for key in keys:
        points = [
            (r["step"], float(r[key])) for r in records if isinstance(r.get(key), int | float)
        ]
        if points:
            out[key] = ([p[0] for p in points], [p[1] for p in points])
    return out


def time_split(record: dict[str, Any]) -> dict[str, float] | None:
    """One step's seconds as rollout / log-probs / train / sync / eval / other, summing to
    ``time/step``. Rollout: its phase and, in the overlapping loops, the wait for it, less
    a colocated hand-over to the engines. Log-probs and train: the workers' own compute
    when recorded, else the phases' wall time. Other: the rest (orchestration, data
    movement, colocated turns, idle): ``time/overhead_excl_sync`` less any eval."""
    step = record.get("time/step")
    if not isinstance(step, int | float):
        return None

    def seconds(*keys: str) -> float:
        for key in keys:
            if isinstance(record.get(key), int | float):
                return float(record[key])
        return 0.0

    parts = {
        "rollout": seconds("time/rollout")
        + seconds("time/rollout_wait")
        - seconds("time/turns/in_rollout"),
        "log-probs": seconds("time/log_probs_compute", "time/log_probs"),
        "train": seconds("time/train_compute", "time/train"),
        "sync": seconds("time/sync"),
        "eval": seconds("time/eval"),
    }
    parts = {name: max(value, 0.0) for name, value in parts.items()}
    parts["other"] = max(float(step) - sum(parts.values()), 0.0)
    return parts


def time_split_series(records: list[dict[str, Any]]) -> Series:
    """:func:`time_split` of every step that has a ``time/step``, as chart series (a part
    that is zero at every step is left out)."""
    splits = [(r["step"], split) for r in records if (split := time_split(r))]
    out: Series = {}
    for name in splits[0][1] if splits else ():
        values = [split[name] for _, split in splits]
        if any(values):
            out[name] = ([step for step, _ in splits], values)
    return out


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write every chart the metrics allow; returns their paths."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    for name, (key, title) in LINE_CHARTS.items():
        if data := series(records, [key]):
            written.append(_line_chart(out_dir / f"{name}.png", data, title))
    eval_keys = sorted({k for r in records for k in r if k.startswith("eval/") and "pass@" in k})
    if data := series(records, eval_keys):
        written.append(_line_chart(out_dir / "eval_pass_at_k.png", data, "eval pass@k"))
    if data := time_split_series(records):
        written.append(_time_chart(out_dir / "time_split.png", data))
    if not written:
        raise ValueError(
            f"{run_dir / 'metrics.jsonl'} has none of the charted metrics "
            f"({', '.join(k for k, _ in LINE_CHARTS.values())}, eval/*/pass@k, time/*)"
        )
    return written


def _figure(title: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.0), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)  # render with Agg: no display, no global pyplot state
    axes = figure.add_subplot()
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.grid(alpha=0.3)
    return figure, axes


def _line_chart(path: Path, data: Series, title: str) -> Path:
    figure, axes = _figure(title)
    for key, (steps, values) in data.items():
        axes.plot(steps, values, marker="o" if len(steps) < 30 else None, label=key)
    if len(data) > 1:
        axes.legend(fontsize="small")
    figure.savefig(path, format="png")
    return path


def _time_chart(path: Path, data: Series) -> Path:
    """Stacked seconds per step of each part. The y axis stops at 1.5 times the slowest
    step after the third (start-up steps, e.g. compilation, would flatten the rest)."""
    figure, axes = _figure("step time split")
    steps = next(iter(data.values()))[0]
    stacks = [values for _, values in data.values()]
    axes.stackplot(steps, stacks, labels=list(data))
    totals = [sum(values) for values in zip(*stacks, strict=True)]
    if len(totals) > 5 and max(totals[3:]) > 0:
        top = 1.5 * max(totals[3:])
        if max(totals[:3]) > top:
            axes.set_ylim(0, top)
            axes.set_title("step time split (first steps clipped)")
    axes.set_ylabel("seconds")
    axes.legend(fontsize="small", loc="upper left")
    figure.savefig(path, format="png")
    return path
