"""Which manager is a communicator's: one per communicator, found through an
MPI attribute cached on it.

Every Python wrapper of the same handle gets the same manager, and a
freed-then-reused handle does not: freeing the communicator runs our
attribute delete callback, which only records (no MPI call there); the
manager leaves its family at the family's next sync point, or at the next
lookup if it was the family's last, once nothing registered on it is left.
"""

from __future__ import annotations

import threading
import weakref
from threading import get_ident as _get_ident
from typing import Any

from mpi4py import MPI

from . import _collective, _interrupts, _manager
from ._errors import CollectiveGCError
from ._manager import Manager

__all__ = ["manager", "lookup", "managers", "release_freed", "check_comm"]

_REGISTRY_LOCK = threading.RLock()
_MANAGERS: list[Manager] = []
_KEYVAL: list[int] = []
# A weak reference to the communicator object of the last lookup, and its
# manager: a cache for many registrations on one communicator. One pair,
# written in one store and read in one load, so that no thread reads one
# lookup's reference with another's manager (two stores are not torn under
# the GIL, which switches threads at calls and jumps only; without it, they
# would be).
_NOTHING: tuple[Any, Manager | None] = (None, None)
_LAST: list[tuple[Any, Manager | None]] = [_NOTHING]
# Managers whose communicator was freed, appended by the delete callback.
_FREED: list[Manager] = []
# Whether a communicator was freed since the main thread's last release (see
# manager): set by the delete callback.
_freed_since = False
_MAIN = threading.main_thread().ident


def _delete_attr(comm: MPI.Comm, keyval: int, mgr: Manager) -> None:
    # An MPI attribute delete callback: record only, never call MPI here.
    global _freed_since
    _manager.comm_was_freed(mgr)
    _FREED.append(mgr)
    _freed_since = True
    if _LAST[0][1] is mgr:
        _LAST[0] = _NOTHING  # the cache never gives a freed communicator's manager


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


def lookup(comm: MPI.Comm) -> Manager | None:
    """The manager of ``comm`` if it has one, else None. Local."""
    ref, mgr = _LAST[0]
    if mgr is not None and ref() is comm:
        return mgr
    c = check_comm(comm)
    if not _KEYVAL:
        return None
    found = c.Get_attr(_KEYVAL[0])
    return found if isinstance(found, Manager) else None


def manager(comm: MPI.Comm) -> Manager:
    """The manager of ``comm``: the same object each time for the same communicator.

    Local: making a manager sends no message (it joins its family, or makes
    one with its private duplicate, at its first registration, sync point or
    scope, which are collective anyway).
    """
    global _freed_since
    # A communicator freed since the last time: its manager let go first,
    # cache or not. Letting one go lists its family's children for
    # adoption, which posts a barrier over each child's private duplicate,
    # so every rank must do it before the same collectives (the main
    # thread's next call after the free), not wherever its cache happens to
    # miss: a rank that ran a child's sync point first would pair its
    # agreement with the others' barrier. (Not from other threads, nor
    # inside a region, a destroy's: at a moment of their own. Managers kept
    # for their registrations are tried again at cache misses, as before.)
    if _freed_since and _get_ident() == _MAIN and not _interrupts.REGION.depth:
        _freed_since = False
        release_freed()
    # The cache, inline: this runs at every registration and sync point
    # (a freed communicator's manager leaves it: _delete_attr).
    ref, mgr = _LAST[0]
    if mgr is not None and ref() is comm:
        return mgr
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
            mgr = Manager(c, _forget)
            c.Set_attr(kv, mgr)
            _MANAGERS.append(mgr)
    # A weak reference: holding the user's communicator object would keep a
    # managed one (cgc.dup) alive for ever.
    _LAST[0] = (weakref.ref(comm), mgr)
    return mgr


def managers() -> list[Manager]:
    """Every manager in use in this process, in the order they were made. Local.

    (Collective work goes by family, whose order is the same on every rank:
    :func:`collective_gc._collective.families`.)
    """
    with _REGISTRY_LOCK:
        return list(_MANAGERS)


def _forget(mgr: Manager) -> None:
    with _REGISTRY_LOCK:
        if mgr in _MANAGERS:
            _MANAGERS.remove(mgr)
        if _LAST[0][1] is mgr:
            _LAST[0] = _NOTHING


def release_freed() -> None:
    """Let go of the managers of freed communicators that have nothing left
    and are the last of their family (a family with other members lets them
    go at one of its sync points instead, at the same point on every rank).
    Local: at a moment of this rank's own, so the last communicator of a
    family a parent reaches, freed on a thread other than the one running
    the parent's sync points, is not promised (docs/design.rst).

    One that still holds registrations stays: its destroys are agreed at the
    family's sync points, or at exit, over its private duplicate.
    """
    if MPI.Is_finalized():
        return
    # One protected region: a manager is let go of whole (its registrations
    # detached and named, its family left) or not at all, whatever signal comes.
    entered = _interrupts.enter()
    try:
        keep = []
        for mgr in list(_FREED):
            fam = _manager.family(mgr)
            others = fam is not None and any(
                m is not mgr and not m.comm_freed for _, m in fam.live_members()
            )
            if (
                mgr.state is not _collective.State.OPEN
                and mgr.state is not _collective.State.UNUSABLE
            ):
                _forget(mgr)
            elif not others and not mgr.registered:
                _manager.let_go(mgr, _collective.State.RELEASED, "its communicator was freed")
                _forget(mgr)
            elif fam is None or not others:
                keep.append(mgr)
            else:
                _forget(mgr)  # its family's sync point lets it go (comm_was_freed queued it)
        _FREED[:] = keep
    finally:
        _interrupts.leave(entered)


def after_fork() -> list[Any]:
    """In a forked child: every manager belongs to the parent. A fresh lock:
    one that another thread held at the fork is never released there.
    Returns the registrations' calls, which the child keeps."""
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.RLock()
    _LAST[0] = _NOTHING
    _manager.after_fork(_MANAGERS)
    return _collective.after_fork()
