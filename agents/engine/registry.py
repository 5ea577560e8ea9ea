"""Named registries of pluggable parts (rollout backends, policy losses, advantage estimators): a new part is one
``register`` call where it is defined, and every setting, check and command-line choice that names parts reads the
registry when it runs, so a part registered after import is accepted there too.

:class:`Registry` keeps ``{name: entry}`` in registration order; :meth:`Registry.get` refuses an unknown name in one
line naming the registered ones; :meth:`Registry.registered` adds an entry for a ``with`` block (tests);
:class:`Names` is a live, read-only, tuple-like view of the names (what the old ``SAMPLERS`` / ``LOSSES`` tuples
were).
"""

from __future__ import annotations

import contextlib
from typing import Generic, Iterator, TypeVar

__all__ = ["Names", "Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries of one kind by name (``kind`` words the one-line error: ``unknown loss 'x'; registered: ...``)."""

    def __init__(self, kind: str, setting: str | None = None):
        self.kind = kind
        self.setting = setting
        """The config field that names an entry, for the error (e.g. ``loss``)."""
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        """Add (or replace) ``name``; returns ``entry``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
        self._entries[name] = entry
        return entry

    def remove(self, name: str) -> T:
        """Take ``name`` out (what a test registers, it removes); returns its entry."""
        return self._entries.pop(name)

    @contextlib.contextmanager
    def registered(self, name: str, entry: T) -> Iterator[T]:
        """``entry`` registered as ``name`` inside the block; afterwards the previous entry (or none) again."""
        before = self._entries.get(name)
        self.add(name, entry)
        try:
            yield entry
        finally:
            if before is None:
                self._entries.pop(name, None)
            else:
                self._entries[name] = before

    def get(self, name: str) -> T:
        """The entry ``name``; an unknown one is a one-line ``ValueError`` naming the registered ones."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            what = f"{self.setting}={name!r}" if self.setting else repr(name)
            raise ValueError(f"unknown {self.kind} {what}; registered: {', '.join(self._entries)}") from None

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


class Names:
    """A read-only view of a registry's names that behaves as the tuple of them now (iteration, ``in``, ``len``,
    indexing, equality with a tuple), following later registrations."""

    def __init__(self, registry: Registry):
        self._registry = registry

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry.names())

    def __len__(self) -> int:
        return len(self._registry.names())

    def __contains__(self, name: object) -> bool:
        return name in self._registry

    def __getitem__(self, i):
        return self._registry.names()[i]

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, (tuple, list, Names)) else other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(self._registry.names())
