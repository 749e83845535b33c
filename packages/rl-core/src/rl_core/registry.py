"""Name -> object registries that reject unknown and duplicate names with a helpful message."""

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named table of implementations (advantage estimators, policy losses, filters, ...).

    >>> losses = Registry("policy loss")
    >>> @losses.register("ppo")
    ... def ppo(...): ...
    >>> losses.get("ppo")
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator adding ``obj`` under ``name``; a name already taken raises ValueError."""

        def add(obj: T) -> T:
            if name in self._entries:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered; pick another name "
                    f"(taken: {', '.join(self.names())})"
                )
            self._entries[name] = obj
            return obj

        return add

    def get(self, name: str) -> T:
        """The entry called ``name``; an unknown name raises ValueError listing the known ones."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
