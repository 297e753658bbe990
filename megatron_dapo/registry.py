"""A name -> object registry for swappable pieces (losses, advantages, aggregation, reward functions).

No torch import here: reward worker processes import the reward registry and must stay light.
"""

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to implementations; lookups of unknown names list the valid ones.

    Registering a second, different object under a taken name is an error, so two modules cannot
    silently shadow each other's variant.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            existing = self._entries.get(name)
            if existing is not None and existing is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered to {existing!r}")
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; valid names: {sorted(self._entries)}"
            ) from None

    def unregister(self, name: str) -> None:
        """Removes ``name`` (a plug-in's or a test's entry, registered for a while); absent: nothing."""
        self._entries.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))
