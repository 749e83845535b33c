"""Summary metrics for scored samples: the unbiased pass@k estimator and a batch summary."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, c correct, is correct).

    The unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021), exact in integers.
    Needs 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n} c={c} k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def pass_at_k_by_group(
    group_ids: Sequence[Hashable], correct: Sequence[bool], ks: Sequence[int]
) -> dict[str, float]:
    """Mean over groups of pass@k, for each k; groups with fewer than k samples are skipped
    for that k (and a k no group reaches is left out of the result)."""
    groups: dict[Hashable, list[bool]] = {}
    for group_id, is_correct in zip(group_ids, correct, strict=True):
        groups.setdefault(group_id, []).append(bool(is_correct))
    result = {}
    for k in ks:
        values = [pass_at_k(len(g), sum(g), k) for g in groups.values() if len(g) >= k]
        if values:
            result[f"pass@{k}"] = sum(values) / len(values)
    return result


def summarize_scores(
    scores: Sequence[float],
    statuses: Sequence[str],
    *,
    group_ids: Sequence[Hashable] | None = None,
    ks: Sequence[int] = (1,),
    threshold: float = 1.0,
) -> dict[str, float | int]:
    """Mean score, error and timeout counts, and pass@k per group (correct = score >= threshold)."""
    summary: dict[str, float | int] = {
        "num_scored": len(scores),
        "mean": sum(scores) / len(scores) if scores else 0.0,
        "num_errors": sum(s == "error" for s in statuses),
        "num_timeouts": sum(s == "timeout" for s in statuses),
    }
    if group_ids is not None:
        correct = [score >= threshold for score in scores]
        summary.update(pass_at_k_by_group(group_ids, correct, ks))
        summary["num_groups"] = len(set(group_ids))
    return summary
