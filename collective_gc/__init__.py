"""collective_gc: collective deferred destruction for MPI programs.

Objects that wrap collective resources register with the manager of their
communicator; their finalization, by either collector, on any thread, only
queues a destroy request, and the destroys run at collective sync points in
one order agreed by every rank.
"""

from __future__ import annotations

import os as _os
from importlib.util import find_spec as _find_spec

from . import _exit  # noqa: F401  (the exit agreement and fork handling)
from ._api import collect, pending, register
from ._comms import dup, split
from ._diagnose import find_cycles, view
from ._errors import (
    CollectiveGCError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CyclicFinalizationError,
    CyclicFinalizationWarning,
    DestroyError,
    ExitLeakWarning,
    RegistrationError,
)
from ._keep import keep
from ._lookup import manager, managers
from ._manager import Manager, Snapshot, State
from ._registration import Registration
from ._scope import collective_scope, current_scope, sync_point
from ._syncpoint import CollectStats, Participant

__version__ = "0.1.0"

# COLLECTIVE_GC_TRACE=path: trace every sync point from the start (collective_gc.trace).
if _os.environ.get("COLLECTIVE_GC_TRACE"):
    from .trace import start_from_environment as _start_trace

    _start_trace()


def __getattr__(name: str) -> object:
    # parallel_assert lives in the pytest plugin, which imports pytest: load it
    # only when asked for, so that importing collective_gc never needs pytest.
    if name == "parallel_assert":
        from .pytest_plugin import parallel_assert

        return parallel_assert
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy name is public (the README lists it): dir() and completion show it.
    return sorted({*globals(), *__all__})


__all__ = [
    "CollectStats",
    "CollectiveGCError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CyclicFinalizationError",
    "CyclicFinalizationWarning",
    "DestroyError",
    "ExitLeakWarning",
    "Manager",
    "Participant",
    "Registration",
    "RegistrationError",
    "Snapshot",
    "State",
    "collect",
    "collective_scope",
    "current_scope",
    "dup",
    "find_cycles",
    "keep",
    "manager",
    "managers",
    "pending",
    "register",
    "split",
    "sync_point",
    "view",
]
# parallel_assert only where pytest is installed: `from collective_gc import *`
# loads every name of __all__, and must not fail for want of a test dependency.
# find_spec looks pytest up without importing it.
if _find_spec("pytest") is not None:
    __all__.append("parallel_assert")
