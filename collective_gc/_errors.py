"""The exception and warning hierarchy of collective_gc."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

__all__ = [
    "CollectiveGCError",
    "RegistrationError",
    "DestroyError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CyclicFinalizationError",
    "CyclicFinalizationWarning",
    "ExitLeakWarning",
    "call_each",
    "raise_in_place_of",
    "in_place_of",
]

_T = TypeVar("_T")


class CollectiveGCError(Exception):
    """Base class of every error raised by collective_gc."""


class RegistrationError(CollectiveGCError, TypeError):
    """A registration was refused: the object or its destroy cannot be managed.

    Also a :class:`TypeError`, since the cause is always the kind of thing passed
    (an object that cannot be weakly referenced, a destroy that is not callable or
    that refers to the object itself).
    """


class DestroyError(CollectiveGCError):
    """One or more destroys raised at a sync point, on this rank or another.

    Raised on every rank of the communicator's family together (its congruent
    communicators share one agreement), at the family's next agreement after the sync
    point whose destroys failed; the message names both sync points. Every agreed
    destroy of that sync point ran. :attr:`failures` lists ``(rank, key, name,
    message)`` for each failed destroy on any rank; :attr:`local` holds this rank's own
    exceptions. A participant's ``finish`` that raised (PETSc's garbage cleanup, say) is
    reported the same way, with key -1 and a name that says which.
    """

    def __init__(
        self,
        message: str,
        failures: list[tuple[int, int, str, str]],
        local: list[BaseException],
    ) -> None:
        super().__init__(message)
        self.failures = failures
        self.local = local


class CollectiveMismatchError(CollectiveGCError):
    """The ranks disagree on the state of a collective (sync-point number or keys)."""


class CollectiveTimeoutError(CollectiveGCError):
    """A sync point did not complete on all ranks before its deadline."""


class CyclicFinalizationError(CollectiveGCError):
    """In strict mode, a managed object was finalized by the cyclic collector."""


class CyclicFinalizationWarning(UserWarning):
    """A managed object was finalized by the cyclic collector (``strict="warn"``)."""


class ExitLeakWarning(RuntimeWarning):
    """Pending collective destroys could not be agreed at exit and were leaked."""


def call_each(
    items: Iterable[_T],
    call: Callable[[_T], Any],
    on_error: Callable[[_T], Any] | None = None,
) -> None:
    """``call(item)`` for every item, even if some raise; then raise the first.

    The later exceptions become notes of the first. ``on_error(item)`` runs for
    each item whose call raised. For destroys of several resources that must
    all be attempted, on every rank, whatever fails.
    """
    first: BaseException | None = None
    for item in items:
        try:
            call(item)
        except Exception as exc:  # every item is still tried; raised after
            if on_error is not None:
                on_error(item)
            if first is None:
                first = exc
            else:
                first.add_note(f"also raised for a {type(item).__name__}: {exc!r}")
    if first is not None:
        try:
            raise first
        finally:
            first = None  # no frame-traceback cycle keeping the items alive


# The key under which an interrupt raised in a failed collective's place
# keeps that failure (see in_place_of).
_IN_PLACE = "collective_gc_in_place_of"


def raise_in_place_of(interrupt: BaseException, error: BaseException) -> None:
    """Mark ``interrupt`` (a rank's KeyboardInterrupt or SystemExit, held for
    the end of its collectives) as raised instead of ``error`` (the timeout
    or mismatch that then ended them); the caller raises it."""
    interrupt.__dict__[_IN_PLACE] = error


def in_place_of(exc: BaseException) -> BaseException | None:
    """The error ``exc`` was raised instead of (see raise_in_place_of), or
    None: what a sync point's caller judges it by (its context alone could
    be any exception being handled when the sync point began)."""
    found = exc.__dict__.get(_IN_PLACE)
    return found if isinstance(found, BaseException) else None
