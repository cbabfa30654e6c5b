"""Which manager is a communicator's: one per communicator, found through an
MPI attribute cached on it.

Every Python wrapper of the same handle gets the same manager, and a
freed-then-reused handle does not: freeing the communicator runs our
attribute delete callback, which only records (no MPI call there); the
manager lets go of its private duplicate at the next lookup or at exit.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from . import _manager
from ._errors import CollectiveGCError
from ._manager import Manager

__all__ = [
    "manager",
    "lookup",
    "managers",
    "release_freed",
    "check_comm",
    "on_first_collective",
    "on_new_manager",
    "retire",
]

_REGISTRY_LOCK = threading.RLock()
_MANAGERS: list[Manager] = []
# Managers of communicators of size > 1 in the order of their first
# collective (the private duplicate's), which is the same on every rank that
# shares them, unlike the order of lookups: the exit agreement and the pytest
# plugin visit managers in this order.
_COLLECTIVE_ORDER: list[Manager] = []
_KEYVAL: list[int] = []
# A weak reference to the communicator object of the last lookup, and its
# manager: a cache for many registrations on one communicator.
_LAST: list[Any] = [None, None]
# Managers whose communicator was freed, appended by the delete callback.
_FREED: list[Manager] = []


# Called with each manager at its first collective (collective_gc._comms:
# a communicator a library made is adopted by a parent's sync points there).
_ON_FIRST: list[Callable[[Manager], None]] = []


# Called with each new manager (local: a view hook, say).
_ON_NEW: list[Callable[[Manager], None]] = []


def on_new_manager(hook: Callable[[Manager], None]) -> None:
    """Call ``hook(mgr)`` when a manager is made (a local moment: it must not
    make MPI calls). Local."""
    if hook not in _ON_NEW:
        _ON_NEW.append(hook)


def on_first_collective(hook: Callable[[Manager], None]) -> None:
    """Call ``hook(mgr)`` at each manager's first collective (the making of its
    private duplicate: collective over its communicator, so every rank of it
    calls the hook at the same point of the program). Local."""
    if hook not in _ON_FIRST:
        _ON_FIRST.append(hook)


def _first_collective(mgr: Manager) -> None:
    with _REGISTRY_LOCK:
        _COLLECTIVE_ORDER.append(mgr)
    for hook in _ON_FIRST:
        hook(mgr)


def _delete_attr(comm: MPI.Comm, keyval: int, mgr: Manager) -> None:
    _manager.comm_was_freed(mgr)
    _FREED.append(mgr)


def _keyval() -> int:
    if not _KEYVAL:
        _KEYVAL.append(MPI.Comm.Create_keyval(delete_fn=_delete_attr))
    return _KEYVAL[0]


def check_comm(comm: object) -> MPI.Intracomm:
    """Refuse what is not a usable intracommunicator, with a clear error."""
    if MPI.Is_finalized():
        raise CollectiveGCError("MPI is already finalized")
    if isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL:
        raise ValueError("the communicator is MPI.COMM_NULL (freed, or this rank is not in it)")
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(
            f"expected an mpi4py intracommunicator, got {type(comm).__name__!r} object"
            + (" (use comm=None for a rank-local registration)" if comm is None else "")
        )
    return comm


def _cached(comm: object) -> Manager | None:
    last = _LAST
    mgr = last[1]
    if mgr is not None and last[0]() is comm and not mgr.comm_freed:
        # The same Python object as last time, and its handle was not freed
        # (freeing runs our attribute delete callback): the same manager.
        return mgr  # type: ignore[no-any-return]
    return None


def lookup(comm: MPI.Comm) -> Manager | None:
    """The manager of ``comm`` if it has one, else None. Local."""
    mgr = _cached(comm)
    if mgr is not None:
        return mgr
    c = check_comm(comm)
    if not _KEYVAL:
        return None
    found = c.Get_attr(_KEYVAL[0])
    return found if isinstance(found, Manager) else None


def manager(comm: MPI.Comm) -> Manager:
    """The manager of ``comm``: the same object each time for the same communicator.

    Local: making a manager sends no message (its private duplicate is made
    by the first registration or sync point, which are collective anyway).
    """
    # _cached, inline: this runs at every registration.
    mgr = _LAST[1]
    if mgr is not None and _LAST[0]() is comm and not mgr.comm_freed:
        return mgr  # type: ignore[no-any-return]
    c = check_comm(comm)
    if _FREED:
        release_freed()
    kv = _keyval()
    # Get or create under the lock: two threads making the first lookup of
    # one communicator must get one manager (a second Set_attr would replace
    # the first, and MPI would run the delete callback on it).
    with _REGISTRY_LOCK:
        found = c.Get_attr(kv)
        if isinstance(found, Manager):
            mgr = found
        else:
            mgr = Manager(c, _first_collective, _forget)
            c.Set_attr(kv, mgr)
            _MANAGERS.append(mgr)
            for hook in _ON_NEW:
                hook(mgr)
    # A weak reference: holding the user's communicator object would keep a
    # managed one (cgc.dup) alive for ever.
    _LAST[0], _LAST[1] = weakref.ref(comm), mgr
    return mgr


def managers() -> list[Manager]:
    """Every manager in use in this process. Local.

    Those of communicators of size > 1 come first, in the order of their
    first collective use (the same on every rank that shares them), then the
    others in the order they were made.
    """
    with _REGISTRY_LOCK:
        ordered = list(_COLLECTIVE_ORDER)
        seen = set(map(id, ordered))
        return ordered + [m for m in _MANAGERS if id(m) not in seen]


def _forget(mgr: Manager) -> None:
    with _REGISTRY_LOCK:
        if mgr in _MANAGERS:
            _MANAGERS.remove(mgr)
        if mgr in _COLLECTIVE_ORDER:
            _COLLECTIVE_ORDER.remove(mgr)
        if _LAST[1] is mgr:
            _LAST[0] = _LAST[1] = None


def release_freed() -> None:
    """Let go of the managers of freed communicators that have nothing left. Local.

    One that still holds registrations stays: its destroys are agreed at
    exit (or at a sync point someone runs on it), over its private duplicate.
    """
    if MPI.Is_finalized():
        return
    keep = []
    for mgr in list(_FREED):
        if _manager.release(mgr):
            _forget(mgr)
        elif mgr.registered:
            keep.append(mgr)
    _FREED[:] = keep


def retire(mgr: Manager, comm: MPI.Intracomm | None) -> bool:
    """Let go of ``mgr`` while its communicator ``comm`` may live on (None: it
    was freed), if nothing is registered on it: its private duplicate is
    freed, and a later lookup of ``comm`` makes a fresh manager. True if done.

    Collective in effect (freeing the private duplicate is): call it on every
    rank of the communicator at the same point, as a parent's sync point does
    for the communicators it reaches (see collective_gc._comms).
    """
    if not _manager.release(mgr):
        return False
    _forget(mgr)
    if comm is not None and _KEYVAL and not mgr.comm_freed:
        with _REGISTRY_LOCK:
            if comm.Get_attr(_KEYVAL[0]) is mgr:
                comm.Delete_attr(_KEYVAL[0])  # runs _delete_attr: not a real free
        if mgr in _FREED:
            _FREED.remove(mgr)
    return True


def after_fork() -> None:
    """In a forked child: every manager belongs to the parent. A fresh lock:
    one that another thread held at the fork is never released there."""
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.RLock()
    _LAST[0] = _LAST[1] = None
    for mgr in _MANAGERS:
        _manager.after_fork(mgr)
