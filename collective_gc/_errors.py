"""The exception and warning hierarchy of collective_gc."""

from __future__ import annotations

__all__ = [
    "CollectiveGCError",
    "RegistrationError",
    "DestroyError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CyclicFinalizationError",
    "CyclicFinalizationWarning",
    "ExitLeakWarning",
]


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

    Raised on every rank of the communicator together, after every agreed destroy
    has run. :attr:`failures` lists ``(rank, key, name, message)`` for each failed
    destroy on any rank; :attr:`local` holds this rank's own exceptions.
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
