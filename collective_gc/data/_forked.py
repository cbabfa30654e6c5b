"""What a forked child of a loader's process lets go of.

A forked child must take its copies out of what the parent shares: its
segments' mappings and its producers' states, tracked here from when each
is made (:class:`Tracked`), and its copies of the descriptors of the
parent's channels and workers (:func:`close_fields`).

A tracked object is found again by the child's fork handler. Tracking must
not keep it alive, and what runs when it dies must run no Python code (NOTE
[ Loader shutdown and interrupts ] in _loader, rule 5): each is held by a
weak reference whose callback is a list's C-level ``append``, and the dead
ones are dropped at the next :meth:`Tracked.add` (not a
``weakref.WeakSet``: its callback is Python code).
"""

from __future__ import annotations

import os
import weakref
from typing import Generic, TypeVar

__all__ = ["Tracked", "close_fields"]

T = TypeVar("T")


class _Ref(weakref.ref):  # type: ignore[type-arg]
    """A weak reference compared by identity: weakref.ref's own comparison
    would compare the referents (two equal mappings are two mappings)."""

    __slots__ = ()

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__


class Tracked(Generic[T]):
    """The live objects added, by identity, without keeping them alive."""

    __slots__ = ("_refs", "_dead")

    def __init__(self) -> None:
        self._refs: set[_Ref] = set()
        self._dead: list[_Ref] = []  # appended to by the references' callback

    def add(self, obj: T) -> None:
        """Track ``obj`` until it dies (or :meth:`take`)."""
        dead = self._dead
        while dead:
            try:
                ref = dead.pop()
            except IndexError:  # another thread took the last one
                break
            self._refs.discard(ref)
        self._refs.add(_Ref(obj, dead.append))

    def take(self) -> list[T]:
        """The objects still alive, forgotten here: in a forked child's
        handler, where only the forking thread exists."""
        alive = [obj for obj in (ref() for ref in self._refs) if obj is not None]
        self._refs.clear()
        self._dead.clear()
        return alive


def close_fields(obj: object, names: tuple[str, ...]) -> None:
    """In a forked child: close this process's copies of the descriptors in
    ``obj``'s fields ``names`` (each set to -1 before its close), every one
    whatever another's close raised (a close cut short by the fork may have
    closed it already). Never a ``shutdown()``: that would cut the parent's
    connection too."""
    for name in names:
        fd = getattr(obj, name)
        if fd >= 0:
            setattr(obj, name, -1)
            try:
                os.close(fd)
            except OSError:  # closed already (a close cut short by the fork): the rest still close
                pass
