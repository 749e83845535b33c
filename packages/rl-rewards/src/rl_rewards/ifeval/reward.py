"""The ``ifeval`` reward: the fraction (or all-of) of a sample's verifiable instructions met.

Label forms: ``[{"id": ..., "kwargs": {...}}, ...]``, ``{"instructions": [...]}``, or IFEval's
``{"instruction_id_list": [...], "kwargs": [...]}``.
"""

from __future__ import annotations

from rl_rewards.ifeval.checkers import check_instruction
from rl_rewards.registry import register_reward

_MODES = ("all", "fraction")


def instructions_from_label(label: object) -> list[tuple[str, dict]]:
    """The (id, kwargs) pairs of a label in any of the module docstring's forms."""
    if isinstance(label, dict) and "instruction_id_list" in label:
        ids, kwargs = (
            label["instruction_id_list"],
            label.get("kwargs") or [{}] * len(label["instruction_id_list"]),
        )
        return [
            (i, {k: v for k, v in (kw or {}).items() if v is not None})
            for i, kw in zip(ids, kwargs, strict=True)
        ]
    if isinstance(label, dict):
        label = label.get("instructions")
    if not isinstance(label, list) or not label:
        raise ValueError("ifeval label needs a non-empty list of {'id': ..., 'kwargs': {...}}")
    return [(item["id"], dict(item.get("kwargs") or {})) for item in label]


@register_reward(
    "ifeval", "instruction following: verifiable checks; score = fraction or all-of (mode)"
)
def ifeval_reward(response: str, label: object, *, mode: str = "fraction") -> float:
    """Fraction of instructions followed (``mode="fraction"``) or 1/0 for all of them."""
    if mode not in _MODES:
        raise ValueError(f"unknown ifeval mode {mode!r}; valid: {list(_MODES)}")
    results = [check_instruction(i, response, **kw) for i, kw in instructions_from_label(label)]
    if mode == "all":
        return float(all(results))
    return sum(results) / len(results)
