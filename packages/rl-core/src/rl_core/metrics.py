"""Evaluation metrics: the unbiased pass@k estimator and batch summaries."""

import math
from collections.abc import Iterable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c correct) is correct.

    Unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021), computed as a stable
    product. Needs 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    failure = 1.0
    for i in range(n - c + 1, n + 1):
        failure *= 1.0 - k / i
    return 1.0 - failure


def pass_at_k_groups(
    correct_by_group: Iterable[Sequence[bool]], ks: Sequence[int]
) -> dict[str, float]:
    """Mean pass@k over groups (one group = the samples of one prompt), for each k.

    A k larger than a group's sample count is skipped for that group; the key is
    ``pass@{k}``. Groups whose size is below every k contribute nothing.
    """
    totals = {k: [0.0, 0] for k in ks}
    for group in correct_by_group:
        n, c = len(group), sum(bool(x) for x in group)
        for k in ks:
            if k <= n:
                totals[k][0] += pass_at_k(n, c, k)
                totals[k][1] += 1
    return {f"pass@{k}": total / count for k, (total, count) in totals.items() if count}


def summarize(values: Iterable[float], prefix: str) -> dict[str, float]:
    """``{prefix}/mean``, ``/std`` (population), ``/min``, ``/max`` of the finite values, and
    ``{prefix}/count``; NaN and inf are left out and counted in ``{prefix}/nonfinite``."""
    finite, nonfinite = [], 0
    for value in values:
        if math.isfinite(value):
            finite.append(float(value))
        else:
            nonfinite += 1
    summary = {f"{prefix}/count": float(len(finite)), f"{prefix}/nonfinite": float(nonfinite)}
    if finite:
        mean = sum(finite) / len(finite)
        summary[f"{prefix}/mean"] = mean
        summary[f"{prefix}/std"] = math.sqrt(sum((v - mean) ** 2 for v in finite) / len(finite))
        summary[f"{prefix}/min"] = min(finite)
        summary[f"{prefix}/max"] = max(finite)
    return summary
