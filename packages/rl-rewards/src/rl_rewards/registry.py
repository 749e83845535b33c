"""Reward registry: every reward is a plain function ``fn(response, label, **options) -> float``
registered under a unique name with a one-line description.

Rewards are picked by name (``get_reward("math")``); an unknown or duplicate name raises a
``ValueError`` that lists the valid ones. A name of the form ``pkg.module:function`` loads a
user function by dotted path instead.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RewardFn = Callable[..., float]


@dataclass(frozen=True)
class RewardSpec:
    """A registered reward: its name, the function and a one-line description."""

    name: str
    fn: RewardFn
    description: str


_REGISTRY: dict[str, RewardSpec] = {}
_BUILTINS_LOADED = False


def register_reward(name: str, description: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering ``fn`` under ``name``; a second use of the same name is an error."""

    def decorate(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY:
            raise ValueError(f"reward {name!r} is already registered; pick another name")
        _REGISTRY[name] = RewardSpec(name, fn, description)
        return fn

    return decorate


def _load_builtins() -> None:
    """Import the modules whose decorators fill the registry (once, on first lookup)."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    for module in ("math.reward", "qa", "choice", "ifeval.reward", "code", "remote", "compose"):
        importlib.import_module(f"rl_rewards.{module}")


def list_rewards() -> list[RewardSpec]:
    """Every registered reward, sorted by name."""
    _load_builtins()
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def load_dotted(path: str) -> Callable[..., Any]:
    """Load ``pkg.module:function`` (or ``pkg.module.function``); ValueError if it is missing."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"dotted path {path!r} must look like 'pkg.module:function'")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {path!r}: {exc}") from exc
    if not callable(target):
        raise ValueError(f"{path!r} is not callable")
    return target


def get_reward(name: str, **options: Any) -> RewardFn:
    """The reward called ``name`` with ``options`` bound as keyword arguments.

    ``name`` is a registered name or a dotted path ``pkg.module:function`` (or
    ``pkg.module.function``). The result is
    picklable (a ``functools.partial`` of a module-level function), so it can be sent to
    worker processes.
    """
    _load_builtins()
    if ":" in name or ("." in name and name not in _REGISTRY):
        fn = load_dotted(name)
    else:
        if name not in _REGISTRY:
            valid = ", ".join(sorted(_REGISTRY))
            raise ValueError(
                f"unknown reward {name!r}; valid names: {valid} (or 'pkg.module:function')"
            )
        fn = _REGISTRY[name].fn
    return functools.partial(fn, **options) if options else fn
