"""``Plugins``: factories selected by name, for the seams a deployment extends without editing
their callers (eviction policies, ``cache/eviction/base.py``; routing policies,
``cluster/routing/base.py``).

Invariants: a name is ``[A-Za-z0-9_]+``; registering a name again replaces its factory (tests,
or a deployment overriding a built-in); asking for a name nobody registered is a
``ConfigError`` that lists the registered ones. Thread-safe: one lock per registry. Imports
only ``errors.py``.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from kvwarm.errors import ConfigError

__all__ = ["Plugins"]

T = TypeVar("T")


class Plugins(Generic[T]):
    """Factories of one kind (``kind`` names it in errors: "eviction policy"), by name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._lock = threading.Lock()
        self._factories: dict[str, T] = {}

    def register(self, name: str, factory: T) -> None:
        if not name or not name.replace("_", "").isalnum():
            raise ConfigError(f"{self.kind} names are [A-Za-z0-9_]+: {name!r}")
        with self._lock:
            self._factories[name] = factory

    def unregister(self, name: str) -> None:
        with self._lock:
            self._factories.pop(name, None)

    def names(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._factories)

    def get(self, name: str) -> T:
        """The factory registered as ``name``; ``ConfigError`` naming the known ones if none."""
        with self._lock:
            factory = self._factories.get(name)
            known = ", ".join(self._factories)
        if factory is None:
            raise ConfigError(f"unknown {self.kind} {name!r}; expected one of {known}")
        return factory
