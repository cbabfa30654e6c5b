"""``keep``: collective resources that are not PETSc objects or MPI handles.

An open ``dolfinx.io.XDMFFile`` closes HDF5 collectively in its C++
destructor, and a C++ mesh frees its communicator there: whichever rank's
collector drops the last Python reference runs that collective alone, while
the other ranks are elsewhere (issue 22: the loop hung at step 2-3). ``keep``
holds the last references itself, in a box that the registration's destroy
empties at the agreed sync point, on every rank in the agreed order: the
destructors run there, and nowhere else.

NOTE [keep's marker]. A registration is a weak reference, and CPython's
cyclic collector clears the weak references to everything it found
unreachable, and calls their callbacks, *before* it runs their finalizers.
A ``__del__`` may resurrect its object (store it somewhere): the owner then
lives again, while its registration is already queued, and its resources
would be dropped under it (issue 32). So :func:`hold` does not register the
owner. It registers a marker, an empty numpy array stored only in the
owner's ``__dict__``. The cyclic collector does not track numpy arrays: it
never finds the marker unreachable and never clears its weak references, so
the marker dies only when its last reference goes, which is when the
owner's ``__dict__`` is freed, which is when the owner itself is freed (by
its reference count, or by the collector once the finalizers ran and the
owner was still unreachable). A resurrected owner keeps its marker, and its
resources, until it really dies. On a rank where the owner lives again, the
destroy is not queued, so no rank runs it (a sync point runs what every rank
queued): the collective destructors stay in step.

NOTE [printed-only destructor errors]. A destructor cannot raise: CPython
hands what escapes ``__del__`` (and C and Cython deallocators, such as
h5py's) to ``sys.unraisablehook``, which prints "Exception ignored in ...".
:func:`reporting_unraisable` installs a hook for the time of one drop that
takes, from the dropping thread only, what is reported there, and raises it
as the destroy's own error afterwards: the sync point then raises
DestroyError on every rank. Other threads' reports go to the hook that was
installed before. What a C++ destructor only writes to stderr, or catches,
is not seen.
"""

from __future__ import annotations

import gc
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from mpi4py import MPI

from ._api import register
from ._errors import RegistrationError
from ._registration import Registration, check_destroy

__all__ = ["keep", "hold", "check_resources", "reporting_unraisable"]

# The key of the owner's __dict__ entry that holds its markers (a tuple).
MARKERS = "__collective_gc_keep__"


def _marker() -> np.ndarray[Any, Any]:
    return np.empty(0, dtype=np.uint8)


# The premise of NOTE [keep's marker], read once: a numpy that tracked its
# arrays in the cyclic collector would make the marker die at the owner's
# first collection, resurrected or not. keep then refuses, saying so.
MARKERS_UNTRACKED = not gc.is_tracked(_marker())


def _dict_of(owner: object) -> dict[str, Any]:
    try:
        d = object.__getattribute__(owner, "__dict__")
    except AttributeError:
        d = None
    if type(d) is not dict:
        raise RegistrationError(
            f"collective_gc.keep needs an owner with a __dict__ (it stores a marker there "
            f"to see the owner's real death); this {type(owner).__name__!r} object has "
            f"{'none' if d is None else 'a ' + type(d).__name__} (__slots__, or a class "
            "written in C): keep on another object that lives exactly as long, such as "
            "a small one of your own that the owner holds"
        )
    return d


def hold(
    owner: object,
    destroy: Callable[..., object],
    *args: Any,
    comm: MPI.Comm,
    name: str,
) -> Registration:
    """Collective over ``comm``: ``register`` ``destroy(*args)`` to run once
    ``owner`` has really died, on every rank (see NOTE [keep's marker]).

    As :func:`collective_gc.register`, except that a finalizer that
    resurrects ``owner`` delays the destroy until ``owner`` dies again, and
    that one owner may hold any number of these. ``owner`` must have a
    ``__dict__`` (RegistrationError otherwise); the registration refers to
    the marker stored there, not to ``owner``.
    """
    owners = _dict_of(owner)
    if not MARKERS_UNTRACKED:
        raise RegistrationError(
            f"collective_gc.keep cannot tell an owner's real death with numpy "
            f"{np.__version__}, which tracks arrays in the cyclic collector"
        )
    marker = _marker()
    reg = register(marker, destroy, *args, comm=comm, name=name)
    # Stored once registered: a refused registration leaves nothing behind.
    # A new tuple each time, so that a copy of the owner (which shares the
    # old one) never loses a marker it holds.
    old = owners.get(MARKERS, ())
    owners[MARKERS] = (*(old if isinstance(old, tuple) else (old,)), marker)
    return reg


def _clear(box: list[object]) -> None:
    box.clear()  # list.clear drops from the end: the last resource goes first


def check_resources(owner: object, resources: tuple[Any, ...], what: str) -> None:
    """Refuse a resource that would keep ``owner`` alive (the owner itself, a
    bound method of it, a partial or closure over it), as ``register``
    refuses such a destroy. Local."""
    for i, resource in enumerate(resources):
        try:
            check_destroy(owner, _clear, (resource,), {})
        except RegistrationError:
            raise RegistrationError(
                f"resource {i} given to {what} (a {type(resource).__name__}) refers to "
                f"the owner, a {type(owner).__name__!r} object: "
                "the registration holds its resources until the owner dies, so the owner "
                "would never die; pass what the owner holds instead"
            ) from None


# -- errors only printed by destructors (NOTE [printed-only destructor errors]) ---

# thread ident -> what was reported on that thread during its drop.
_SINKS: dict[int, list[str]] = {}
_INSTALLING = threading.RLock()
# The hook that was installed before ours: what other threads' reports go to.
_BEFORE: list[Callable[[Any], object] | None] = [None]


def _describe(args: Any) -> str:
    try:
        where = args.err_msg or "Exception ignored in"
        obj = "" if args.object is None else f": {args.object!r}"
        what = "".join(traceback.format_exception_only(args.exc_type, args.exc_value)).strip()
        return f"{where}{obj}: {what}"
    except Exception as exc:  # noqa: BLE001 (a report must not fail)
        return f"an error a destructor reported (its description raised {type(exc).__name__})"


def _hook(args: Any) -> None:
    # Runs where the error happened, possibly inside a finalizer or the
    # collector: it only appends (no lock). The object is not kept: storing
    # it would resurrect an object being finalized.
    sink = _SINKS.get(threading.get_ident())
    if sink is not None:
        sink.append(_describe(args))
        return
    (_BEFORE[0] or sys.__unraisablehook__)(args)


@contextmanager
def _taking() -> Iterator[list[str]]:
    ident = threading.get_ident()
    sink: list[str] = []
    with _INSTALLING:
        outer = _SINKS.get(ident)
        if sys.unraisablehook is not _hook:
            _BEFORE[0] = sys.unraisablehook
            sys.unraisablehook = _hook
        _SINKS[ident] = sink
    try:
        yield sink
    finally:
        with _INSTALLING:
            if outer is None:
                _SINKS.pop(ident, None)
            else:
                _SINKS[ident] = outer
            if not _SINKS and sys.unraisablehook is _hook:
                sys.unraisablehook = _BEFORE[0] or sys.__unraisablehook__
                _BEFORE[0] = None


def reporting_unraisable(what: str, call: Callable[..., object], *args: Any) -> None:
    """``call(*args)``, then raise RuntimeError if a destructor reported an
    error meanwhile on this thread only through ``sys.unraisablehook``. Local.

    If ``call`` raises, that exception is raised, with those reports as notes.
    """
    with _taking() as sink:
        try:
            call(*args)
        except BaseException as exc:
            for line in sink:
                exc.add_note(f"also reported while {what}: {line}")
            raise
    if sink:
        counts: dict[str, int] = {}
        for line in sink:
            counts[line] = counts.get(line, 0) + 1
        lines = "; ".join(line if n == 1 else f"{line} (x{n})" for line, n in counts.items())
        raise RuntimeError(
            f"{len(sink)} error(s) that destructors could only print while {what} "
            f"(so what they release may not be released): {lines}"
        )


# -- keep ---------------------------------------------------------------------------


def _drop(box: list[object]) -> None:
    # Emptying the box drops what may be the last references: the resources'
    # own destructors (collective ones included) run here, at the sync point.
    reporting_unraisable("dropping the kept resources", _clear, box)


def _from_h5py(obj: object) -> bool:
    # Read from the type's module name: the core never imports h5py.
    return type(obj).__module__.partition(".")[0] == "h5py"


def keep(
    owner: object, *resources: object, comm: MPI.Comm, name: str | None = None
) -> Registration:
    """Collective over ``comm``: hold ``resources`` until ``owner`` has died
    on every rank, then drop them at a sync point of ``comm``, in the agreed order.

    For resources whose destructor is collective and that have no destroy
    call of their own to register (an open ``dolfinx.io.XDMFFile`` or
    ``VTXWriter``, a C++ mesh): once this registration holds them, let go of
    every other reference (``owner`` may keep them as attributes: those go
    with it). The resources are dropped last first, when the destroy runs;
    if a reference survives elsewhere, its destructor runs when that one
    goes instead. An error that a destructor can only print while they are
    dropped ("Exception ignored in ...", through ``sys.unraisablehook``, on
    the dropping thread) fails the destroy: the sync point raises
    :class:`~collective_gc.DestroyError` on every rank. What a C++
    destructor writes to stderr itself, or swallows, is not seen.

    Calls :func:`collective_gc.register` (same rules: every rank keeps the
    same things in the same order). ``owner`` must have a ``__dict__``:
    keep stores a marker there, and the resources are dropped only once the
    owner is really freed, so an owner whose ``__del__`` resurrects it keeps
    them until it dies again. One owner may keep resources any number of
    times. Refused with :class:`~collective_gc.RegistrationError`, before
    anything is registered: an owner without a ``__dict__``; a resource that
    refers to the owner (the owner itself, a bound method of it, a partial
    or closure over it), since the owner would then never die; h5py objects
    (an HDF5 file closes only once nothing in it is open, so dropping
    references closes it or not depending on their order and on references
    elsewhere): use :func:`collective_gc.h5py.manage`.
    """
    for i, resource in enumerate(resources):
        if _from_h5py(resource):
            raise RegistrationError(
                f"resource {i} given to collective_gc.keep is an h5py "
                f"{type(resource).__name__}: dropping h5py objects closes an HDF5 file "
                "only if nothing in it is still open, so whether the file is closed (and "
                "readable) depends on the order and on references elsewhere; use "
                "collective_gc.h5py.manage(owner, file, comm=...), which closes the file "
                "explicitly at the sync point, what is open in it first"
            )
    check_resources(owner, resources, "collective_gc.keep")
    box = list(resources)
    return hold(owner, _drop, box, comm=comm, name=name or f"{type(owner).__name__} (kept)")
