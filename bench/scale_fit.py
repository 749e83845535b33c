"""Cost model of the control plane fitted to bench/scale_sim.py's measurements (issue 33).

    python bench/scale_fit.py [--markdown] runs/scale_sim.json [more.json ...]

Each component's per-step cost (median over the steps after the first) is fitted as
``a + b x`` by least squares against what it should grow with (``x``: samples per step,
engines, training ranks, nodes or generated tokens), over every size of one layout,
loop and ``rollout.data_plane``; printed with
the largest relative error of the fit at a measured point, as JSON (one line per
component, layout and loop) for docs/scale.md.
"""

import json
import statistics
import sys
from pathlib import Path

# component -> (how it is read from a step, what it grows with)
COMPONENTS = {
    "driver CPU, rollout (dispatch, gather, rewards)": ("driver_cpu/rollout", "samples"),
    "driver CPU, buffer + old log-probs": ("driver_cpu/log_probs", "samples"),
    "buffer pop_step (advantages, per-rank batches)": ("buffer/pop_step", "samples"),
    "driver CPU, train dispatch": ("driver_cpu/train", "samples"),
    "train dispatch latency": ("time/train_dispatch", "ranks"),
    "Ray bytes (per-rank batches)": ("ray/batch_bytes", "samples"),
    "driver CPU, whole step": ("driver_cpu/step", "samples"),
    "driver CPU, whole step, by tokens": ("driver_cpu/step", "tokens"),
    "weight sync orchestration (sync minus modeled)": ("sync_overhead", "engines"),
    "checkpoint coordination (minus modeled)": ("checkpoint_overhead", "nodes"),
    "router added latency": ("router/added_latency_s", "engines"),
    "driver RSS": ("driver/rss_bytes", "samples"),
}
STARTUP = {
    "placement": ("time/placement", "nodes"),
    "engines and router": ("time/engines_and_router", "engines"),
    "start_run": ("time/start_run", "nodes"),
}


def modeled_sync_s(model: dict) -> float:
    """What the stand-ins spend in a sync by design: the gather and one bucket's
    broadcast time per bucket (buckets go to all engines at once)."""
    gather = model["weight_bytes"] / (model["gather_gb_per_s"] * 1e9)
    return gather + model["weight_bytes"] / (model["weight_gb_per_s"] * 1e9)


def step_value(step: dict, key: str, model: dict) -> float | None:
    if key == "sync_overhead":
        return step["time/sync"] - modeled_sync_s(model) if "time/sync" in step else None
    if key == "checkpoint_overhead":
        return (
            step["time/checkpoint"] - model["checkpoint_s"] if "time/checkpoint" in step else None
        )
    return step.get(key)


def plane(result: dict) -> str:
    """The run's rollout.data_plane (runs from before the option: driver)."""
    return result.get("data_plane", "driver")


def generated_tokens(result: dict) -> float:
    """Response tokens per step: samples x the median of the steps' mean response length."""
    return result["samples_per_step"] * (medians(result, "rollout/response_length_mean") or 0.0)


def growth(result: dict, what: str) -> float:
    if what == "tokens":
        return generated_tokens(result)
    return {
        "samples": result["samples_per_step"],
        "engines": result["num_engines"],
        "ranks": result["num_train_ranks"],
        "nodes": result["gpus"] / 8,
    }[what]


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """``(a, b, max relative error)`` of ``y = a + b x`` by least squares."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    a = mean_y - b * mean_x
    errors = [abs(a + b * x - y) / abs(y) for x, y in zip(xs, ys, strict=True) if y]
    return a, b, max(errors, default=0.0)


def medians(result: dict, key: str) -> float | None:
    steps = result["steps"][1:] or result["steps"]
    values = [v for s in steps if (v := step_value(s, key, result["model"])) is not None]
    return statistics.median(values) if values else None


def fits(results: list[dict]) -> list[dict]:
    rows = []
    runs = [r for r in results if "error" not in r]
    for kind in sorted({(r["layout"], r["loop"], plane(r)) for r in runs}):
        group = sorted(
            (r for r in runs if (r["layout"], r["loop"], plane(r)) == kind),
            key=lambda r: (r["gpus"], generated_tokens(r)),
        )
        for name, (key, what) in COMPONENTS.items():
            points = [
                (growth(r, what), m, r["gpus"]) for r in group if (m := medians(r, key)) is not None
            ]
            rows.append(row(name, *kind, what, points))
        for name, (key, what) in STARTUP.items():
            points = [
                (growth(r, what), r["startup"][key], r["gpus"])
                for r in group
                if key in r["startup"]
            ]
            rows.append(row("start-up: " + name, *kind, what, points))
    return rows


def row(name: str, layout: str, loop: str, data_plane: str, what: str, points: list) -> dict:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    a, b, error = fit_line(xs, ys) if len(points) >= 2 else (float("nan"),) * 3
    return {
        "component": name,
        "layout": layout,
        "loop": loop,
        "data_plane": data_plane,
        "grows_with": what,
        "a": a,
        "b": b,
        "max_rel_error": error,
        "points": {int(g): y for _, y, g in points},
    }


# the per-size table of docs/scale.md: column -> (step key, scale)
TABLE = {
    "step s": ("time/step", 1),
    "driver CPU s": ("driver_cpu/step", 1),
    "CPU share": ("cpu_share", 1),
    "driver us/token": ("cpu_per_token", 1e6),
    "rollout CPU ms": ("driver_cpu/rollout", 1e3),
    "pop_step ms": ("buffer/pop_step", 1e3),
    "train dispatch ms": ("time/train_dispatch", 1e3),
    "Ray MB": ("ray/batch_bytes", 1e-6),
    "sync over ms": ("sync_overhead", 1e3),
    "ckpt over ms": ("checkpoint_overhead", 1e3),
    "router ms": ("router/added_latency_s", 1e3),
    "driver RSS MB": ("driver/rss_bytes", 1e-6),
}


def markdown(results: list[dict]) -> str:
    """One table of medians per run (sizes as rows), then the fits."""
    head = (
        "| GPUs | layout | loop | data plane | engines | ranks | samples | tokens | start-up s | "
    )
    lines = [head + " | ".join(TABLE) + " |", "|" + "---|" * (9 + len(TABLE))]
    for r in sorted(
        (r for r in results if "error" not in r),
        key=lambda r: (r["layout"], r["loop"], r["samples_per_step"], plane(r)),
    ):
        cells = [
            r["gpus"],
            r["layout"],
            r["loop"],
            plane(r),
            r["num_engines"],
            r["num_train_ranks"],
            r["samples_per_step"],
            f"{generated_tokens(r):.0f}",
            f"{r['startup'].get('time/start_run', 0):.0f}",
        ]
        for key, scale in TABLE.values():
            if key == "cpu_share":
                value = medians(r, "driver_cpu/step") / medians(r, "time/step")
            elif key == "cpu_per_token":
                value = medians(r, "driver_cpu/step") / max(generated_tokens(r), 1.0)
            else:
                value = medians(r, key)
            cells.append("" if value is None else f"{value * scale:.3g}")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += [
        "",
        "| component | layout | loop | data plane | grows with | a | b | max rel. error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in fits(results):
        lines.append(
            f"| {f['component']} | {f['layout']} | {f['loop']} | {f['data_plane']} "
            f"| {f['grows_with']} "
            f"| {f['a']:.3g} | {f['b']:.3g} | {f['max_rel_error']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    as_markdown = "--markdown" in argv
    paths = [a for a in argv if a != "--markdown"]
    results = [r for path in paths for r in json.loads(Path(path).read_text())]
    if as_markdown:
        print(markdown(results))
        return
    for line in fits(results):
        print(json.dumps(line))


if __name__ == "__main__":
    main(sys.argv[1:])
