"""The module-level calls: register, collect, pending."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from . import _gcpolicy, local
from ._lookup import lookup, manager
from ._manager import quick_sync
from ._registration import Registration
from ._syncpoint import CollectStats

__all__ = ["register", "collect", "pending", "check_timeout", "add_comm_resolver"]


def register(
    obj: object,
    destroy: Callable[..., object],
    *args: Any,
    comm: MPI.Comm | None,
    name: str | None = None,
    **kwargs: Any,
) -> Registration:
    """Collective over ``comm``: manage ``obj``; when it dies, queue ``destroy(*args, **kwargs)``.

    Every rank registers the same objects in the same order, so the
    registration gets the same key on every rank; a rank that registers in a
    different order makes the next sync point raise
    :class:`CollectiveMismatchError` on every rank. On a communicator of size
    > 1, register from one thread at a time: a registration that starts while
    another thread is registering on the same communicator raises
    :class:`RegistrationError`. On ``COMM_SELF`` (and any communicator of
    size 1) and with ``comm=None``, any thread may register at any time.

    When ``obj`` dies (by refcounting or in the cyclic collector, on any
    thread) the destroy is only queued: it runs at the next sync point on
    ``comm`` (:func:`collect`, a scope's sync) at which every rank has queued
    it, on the thread calling that sync point, newest key first.

    ``comm=None`` makes a rank-local registration, for resources that are safe
    to release from another thread: the destroy runs on a background reaper
    thread soon after ``obj`` dies, exactly once, with no agreement.

    The registration holds only a weak reference to ``obj``, and must not hold
    a strong one: a ``destroy`` or argument that is ``obj``, a bound method of
    it, or a partial or closure over it, is refused with
    :class:`RegistrationError` (as is an object that cannot be weakly
    referenced, a destroy that is not callable, or an object already
    registered on the same communicator). The keyword arguments ``comm`` and
    ``name`` belong to ``register`` and cannot be passed on to the destroy.
    """
    if comm is None:
        return local.register(obj, destroy, *args, name=name, **kwargs)
    return manager(comm).register(obj, destroy, args, kwargs, name)


def check_timeout(timeout: object) -> float | None:
    """``timeout`` as seconds (None: no deadline), or ValueError/TypeError. Local."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds or None, not {timeout!r}")
    if not timeout > 0:  # also refuses nan
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    return None if timeout == float("inf") else float(timeout)


def _check_generation(generation: object) -> None:
    if generation is not None and (isinstance(generation, bool) or generation not in (0, 1, 2)):
        raise ValueError(f"generation must be 0, 1, 2 or None, not {generation!r}")


# Adapters that know how to find the user's communicator of their objects
# (collective_gc.petsc: a PETSc object holds PETSc's inner communicator).
_RESOLVERS: list[Callable[[object], MPI.Comm | None]] = []


def add_comm_resolver(resolve: Callable[[object], MPI.Comm | None]) -> None:
    """Let :func:`collect` find the communicator of objects ``resolve`` knows
    (it returns None for others). Local."""
    if resolve not in _RESOLVERS:
        _RESOLVERS.append(resolve)


def _comm_of(obj: object) -> MPI.Comm:
    if isinstance(obj, MPI.Comm):
        return obj
    for resolve in _RESOLVERS:
        found = resolve(obj)
        if found is not None:
            return found
    inner = getattr(obj, "comm", None)
    if inner is None:
        raise TypeError(
            f"expected an mpi4py intracommunicator, or an object with a .comm that is one; "
            f"got {type(obj).__name__!r} object"
        )
    # petsc4py objects give a petsc4py Comm: its tompi4py() is the mpi4py one.
    convert = getattr(inner, "tompi4py", None)
    if callable(convert) and not isinstance(inner, MPI.Comm):
        inner = convert()
    if not isinstance(inner, MPI.Comm):
        raise TypeError(
            f"the .comm of the {type(obj).__name__!r} object is a {type(inner).__name__!r}, "
            "not an mpi4py communicator"
        )
    return inner


def collect(
    comm: object, *, generation: int | None = 2, timeout: float | None = None
) -> CollectStats:
    """Collective sync point: collect garbage locally, then destroy what all ranks queued.

    ``comm`` is a communicator, or any object with a ``.comm`` attribute that
    is one (a mesh, a solver: as Firedrake's ``garbage_cleanup(mesh)``).

    Runs ``gc.collect(generation)`` on this rank (``None`` skips it), then agrees
    with the other ranks of ``comm`` on the keys every rank has queued and runs
    those destroys, newest first, in the same order on every rank. Keys queued
    on only some ranks stay queued for a later sync point.

    Every rank of ``comm`` must call it: a rank that skips it leaves the others
    waiting in the agreement (for ever, or until ``timeout`` seconds pass, when
    :class:`CollectiveTimeoutError` is raised and the manager becomes
    unusable, on every rank: a rank that arrives after the others gave up
    raises it too). If any destroy raises, on any rank, every agreed destroy
    still runs, and :class:`DestroyError` is raised on every rank by the
    family's next agreement (this communicator's next sync point, or that of
    any communicator congruent with it; the exit, :meth:`Manager.close` and
    a scope's exit run one more that reports it): one collective per sync
    point. A KeyboardInterrupt or SystemExit raised by a destroy is raised
    on its rank at once, after this sync point's collectives. A bad ``timeout`` or
    ``generation`` raises ValueError before any collective.
    """
    t0 = _perf_counter()
    # Without extra calls: an empty sync point is mostly overhead around one
    # small allreduce.
    seconds = None if timeout is None else check_timeout(timeout)
    if generation is not None and generation != 2:
        _check_generation(generation)
    mgr = manager(comm if type(comm) is _INTRACOMM else _comm_of(comm))
    collected = None
    if generation is not None:
        if generation >= 2:
            # A heap a managed scope froze is thawed first, so that nothing
            # frozen that died is missed (a young collection never walks it).
            _gcpolicy.POLICY.thaw()
        collected = gc.collect(generation)
    return quick_sync(
        mgr, t0, collected, None, None if seconds is None else time.monotonic() + seconds
    )


_perf_counter = time.perf_counter
_INTRACOMM = MPI.Intracomm


def pending(comm: MPI.Comm | None) -> list[Registration]:
    """The destroy requests this rank has queued on ``comm``, oldest first.

    Local: no communication, and it changes nothing (a communicator with no
    manager yet has nothing pending).
    """
    if comm is None:
        return []
    mgr = lookup(comm)
    return [] if mgr is None else mgr.pending()
