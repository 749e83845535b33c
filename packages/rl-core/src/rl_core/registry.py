"""Name -> object registries that reject unknown and duplicate names with a helpful message.

Wherever a registry is asked for a name, a dotted path ``pkg.module:function`` may stand
instead: the function is imported (from ``sys.path``) and its signature checked against the
one every entry of that registry is called with, so a user function that could not be
called fails at load with the expected signature, not in the middle of a step.
"""

import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class CallShape:
    """How the entries of a registry are called: ``num_positional`` arguments, then the
    keyword arguments ``keywords``; ``text`` is the signature as documentation writes it."""

    num_positional: int
    keywords: tuple[str, ...] = ()
    text: str = ""

    def refusal(self, target: Callable) -> str | None:
        """Why ``target`` cannot be called this way, or None when it can."""
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):  # a builtin without a signature: trust it
            return None
        try:
            signature.bind(*range(self.num_positional), **dict.fromkeys(self.keywords))
        except TypeError as error:
            return f"its signature {signature} cannot be called so ({error})"
        return None


def is_dotted(name: object) -> bool:
    """Whether ``name`` is a dotted path ``pkg.module:function`` rather than a built-in name."""
    return isinstance(name, str) and ":" in name


@functools.cache
def load_dotted(path: str) -> Callable:
    """The object at ``pkg.module:name``, imported from ``sys.path``; ValueError saying why
    it could not be loaded. Each path is imported once per process."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not a dotted path like 'my_pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"cannot load {path!r}: cannot import {module_name!r} ({error}); put it in the "
            "working directory, next to the config file or on PYTHONPATH"
        ) from error
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"cannot load {path!r}: {module_name!r} has no {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{path!r} is {type(target).__name__}, not a function or class")
    return target


def load_checked(path: str, shape: CallShape, kind: str) -> Callable:
    """:func:`load_dotted`, refusing a target that cannot be called as ``shape`` says."""
    target = load_dotted(path)
    refusal = shape.refusal(target)
    if refusal is not None:
        raise ValueError(f"{kind} {path!r}: {refusal}; expected {shape.text}")
    return target


class Registry(Generic[T]):
    """A named table of implementations (advantage estimators, policy losses, filters, ...).

    >>> losses = Registry("policy loss")
    >>> @losses.register("ppo")
    ... def ppo(...): ...
    >>> losses.get("ppo")
    """

    def __init__(
        self,
        kind: str,
        shape: CallShape | None = None,
        *,
        home: str | None = None,
        builtins: tuple[str, ...] = (),
    ):
        """``shape``: how entries are called; with it, :meth:`get` also takes dotted paths.
        ``builtins``: names that the module ``home`` registers when imported; they are known
        (listed, checked, taken) without importing it, which the first :meth:`get` of one
        does (so a config's names are checked without importing torch)."""
        assert home is not None or not builtins, "built-in names need their home module"
        self.kind, self.shape, self.home = kind, shape, home
        self._builtins = frozenset(builtins)
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator adding ``obj`` under ``name``; a name already taken raises ValueError."""

        def add(obj: T) -> T:
            if name in self._builtins and self.home not in sys.modules:
                self._load_builtins()  # a built-in's name: taken, once its home registers it
            if name in self._entries:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered; pick another name "
                    f"(taken: {', '.join(self.names())})"
                )
            self._entries[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        """The entry called ``name``, or the user function at the dotted path ``name``
        (when the registry has a :class:`CallShape`); an unknown name raises ValueError
        listing the known ones."""
        if self.shape is not None and is_dotted(name):
            return load_checked(name, self.shape, self.kind)
        if name in self._builtins and name not in self._entries:
            self._load_builtins()
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}"
                + (" or a dotted path 'pkg.module:function'" if self.shape else "")
            ) from None

    def _load_builtins(self) -> None:
        """Import ``home``, which registers the built-in entries (once per process)."""
        importlib.import_module(self.home)
        missing = self._builtins - self._entries.keys()
        assert not missing, f"{self.home} registers no {self.kind} {sorted(missing)}"

    def names(self) -> list[str]:
        return sorted(self._builtins | self._entries.keys())

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._builtins

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._builtins | self._entries.keys())
