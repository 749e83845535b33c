"""``rl-plot``: PNG charts of a run's metrics.jsonl, written to ``<run_dir>/plots/``.

Charts (each written when its metrics exist): reward, eval pass@k, KL, entropy, response
length and the step-time split. Rendering uses matplotlib's Agg canvas directly (no
pyplot, no display needed).
"""

from pathlib import Path
from typing import Any

from rl_launcher.run_log import TIME_PARTS, read_metrics

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
    if data := series(records, [f"time/{part}" for part in TIME_PARTS]):
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
    """Stacked seconds per step of each phase (a missing phase counts as 0 at that step)."""
    figure, axes = _figure("step time split")
    steps = sorted({s for steps, _ in data.values() for s in steps})
    stacks = []
    for key in data:
        by_step = dict(zip(*data[key], strict=True))
        stacks.append([by_step.get(s, 0.0) for s in steps])
    axes.stackplot(steps, stacks, labels=[k.removeprefix("time/") for k in data])
    axes.set_ylabel("seconds")
    axes.legend(fontsize="small", loc="upper left")
    figure.savefig(path, format="png")
    return path
