"""Which parameters train, by name patterns (slime's ``--only-train-params-name-list`` and
``--freeze-params-name-list``): Python regular expressions matched with ``re.search``
against Hugging Face parameter names (``model.layers.0.mlp.up_proj.weight``).

A name trains when ``train_only`` is empty or one of its patterns matches, and no
``freeze`` pattern matches. Backends apply the answer before building their optimizer
(which then holds only the trained parameters); launchers check the patterns first with
:func:`unmatched_patterns`, since a pattern matching nothing is almost always a typo.
"""

import re
from collections.abc import Iterable, Sequence


def compile_patterns(patterns: Sequence[str], *, field: str) -> list[re.Pattern]:
    """``patterns`` compiled; a bad one raises ValueError naming ``field`` and the error."""
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as error:
            raise ValueError(
                f"{field}: {pattern!r} is not a Python regular expression ({error}); escape "
                "dots and brackets meant literally (layers\\.0\\.)"
            ) from error
    return compiled


def is_trained(name: str, train_only: Sequence[str] = (), freeze: Sequence[str] = ()) -> bool:
    """Whether the parameter ``name`` trains under the two pattern lists."""
    if train_only and not any(re.search(pattern, name) for pattern in train_only):
        return False
    return not any(re.search(pattern, name) for pattern in freeze)


def unmatched_patterns(names: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """The patterns of ``patterns`` that match none of ``names``."""
    names = list(names)
    return [p for p in patterns if not any(re.search(p, name) for name in names)]


def check_patterns(names: Iterable[str], *, train_only=(), freeze=(), prefix="model.") -> None:
    """Raise ValueError when a pattern is not a regular expression, matches no name, or
    the two lists leave nothing to train; messages name the field (``prefix`` + list)."""
    names = list(names)
    for field, patterns in (("train_only", train_only), ("freeze", freeze)):
        compile_patterns(patterns, field=prefix + field)
        missing = unmatched_patterns(names, patterns)
        if missing:
            raise ValueError(
                f"{prefix}{field}: {missing} match no parameter name (re.search over Hugging "
                f"Face names such as {names[0]!r}); fix the pattern or remove it"
            )
    if names and not any(is_trained(name, train_only, freeze) for name in names):
        raise ValueError(
            f"{prefix}train_only={list(train_only)} with {prefix}freeze={list(freeze)} "
            "leaves no parameter to train; narrow freeze or widen train_only"
        )
