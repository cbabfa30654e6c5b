"""petsc4py adapter: PETSc objects destroyed at sync points, PETSc's garbage cleaned there too.

Two kinds of PETSc object need a collective destroy in a Python program:

- objects a wrapper class owns (a solver's KSP, its work Vecs): :func:`manage`
  registers the wrapper so that, once it has died on every rank, ``.destroy()``
  runs on each object at the agreed sync point, in the agreed order;
- petsc4py objects Python drops on its own (temporaries, sub-objects fetched
  with ``ksp.getPC()``): petsc4py >= 3.18 hands them to PETSc's *delayed
  destroy*, which parks them in a per-communicator garbage map until someone
  calls ``PETSc.garbage_cleanup(comm)``. Nothing calls it for the user, so
  memory and communicators pile up. :func:`install` makes every sync point on a
  communicator also clean PETSc's garbage of that communicator and of
  ``COMM_SELF`` (before PETSc 3.20 even serial objects are delayed).

``collective_gc.view(comm)`` shows PETSc's garbage entries beside ours. They are
read from PETSc's own hash map through ``ctypes`` (a local attribute lookup,
no communication), for the PETSc releases whose layout was read
(``CHECKED`` in ``_internals``); with another release, or a build that does
not export what that needs, the view omits them and every sync point calls
``garbage_cleanup`` unconditionally.

A destroy that fails on some ranks leaves PETSc's objects of the
communicator different between ranks: later sync points there refuse, saying
so. An owner that one of its own managed objects refers back to can never
die: :func:`immortal`, the view, the leak check and a warning at exit name it.

petsc4py 3.18 has no KSP/SNES post-solve hooks (``KSP.setPostSolve`` came to
petsc4py in 2024), and a sync point inside one would run while PETSc is in the
middle of the solve, with the solver's own objects possibly among those to
destroy. Make the wrapper's solve method the sync point instead: decorate it
with :func:`collective_gc.sync_point`, or call :func:`solve`.

This package is the only part of collective_gc that imports petsc4py. Its
modules: ``_internals`` (what is read of PETSc through ctypes), ``_cleanup``
(the sync point participant, :func:`install`, the views), ``_destroyers``
(the destroys, from Python or a run in C), ``_keepers`` (owners their own
objects keep alive); this module is the registration side.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

from mpi4py import MPI
from petsc4py import PETSc

from .._api import add_comm_resolver, register
from .._comms import adopt, contains, relation
from .._errors import RegistrationError
from .._lookup import lookup, managers
from .._manager import Manager, family
from .._registration import Registration
from .._scope import sync_point
from . import _internals
from ._cleanup import SERIAL, cleanup_of, immortal, install
from ._destroyers import NATIVE, batch_destroys, destroy_all, destroy_many, destroy_one
from ._keepers import path_to

__all__ = [
    "manage",
    "destroy_all",
    "install",
    "garbage",
    "held",
    "immortal",
    "solve",
    "batch_destroys",
]


def _user_comm(obj: object) -> MPI.Comm | None:
    """The communicator a PETSc object was made on, for ``cgc.collect(obj)``.

    A PETSc object holds PETSc's inner duplicate of it, not the user's, so
    the user's is the managed one whose inner communicator that is.
    """
    if not isinstance(obj, PETSc.Object):
        return None
    if not obj.handle:
        # petsc4py 3.18 crashes reading .comm of a destroyed object.
        raise TypeError(
            f"this PETSc {type(obj).__name__} is destroyed: it has no communicator; "
            "pass the communicator it was made on to collect"
        )
    handle = MPI._handleof(obj.comm.tompi4py())
    reader = _internals.READER
    for mgr in managers():
        if mgr.comm_freed or mgr.broken is not None:
            continue
        if MPI._handleof(mgr.comm) == handle or (
            reader is not None and reader.inner(mgr.comm) == handle
        ):
            return mgr.comm
    raise TypeError(
        f"cannot tell which communicator this PETSc {type(obj).__name__} was made on "
        "(PETSc objects hold PETSc's own duplicate of it, and no managed communicator "
        "has it): pass that communicator to collect"
    )


add_comm_resolver(_user_comm)


def garbage(comm: MPI.Comm) -> list[tuple[int, str]]:
    """This rank's PETSc garbage on ``comm``: ``(creation index, class name)`` pairs. Local.

    These are objects petsc4py handed to PETSc's delayed destroy (Python dropped
    them) that no ``PETSc.garbage_cleanup(comm)`` has destroyed yet. Raises
    RuntimeError if this PETSc build does not let us read its garbage maps.
    """
    reader = _internals.READER
    if reader is None:
        raise RuntimeError(
            "collective_gc.petsc cannot read PETSc's garbage maps with this PETSc build "
            "(its Petsc_*_keyval symbols are not exported); use PETSc.garbage_view(comm)"
        )
    inner = reader.inner(comm)
    return [] if inner is None else reader.entries(inner)


def held(comm: MPI.Comm) -> int:
    """How many of PETSc's inner communicators ``comm``'s family holds on this rank. Local.

    Before its sync points destroy managed parallel PETSc objects, a family
    takes a reference on their inner communicator, which it drops once two
    more sync points have passed with no failure: so a destroy that fails
    on one rank only cannot leave PETSc's inner communicator alive there and
    freed elsewhere, and the program's next PETSc call on the communicator
    (which would hang then) works until the next sync point says what
    failed, on every rank, and refuses the family, which keeps its holds.
    """
    mgr = lookup(comm)  # (a question: no manager is made for it)
    cleanup = None if mgr is None else cleanup_of(mgr)
    return 0 if cleanup is None else len(cleanup.state.holds)


def _describe_object(obj: Any) -> str:
    try:
        name = obj.getName()
    except Exception:  # noqa: BLE001 (a name is only for the message)
        name = None
    return f"{type(obj).__name__} {name!r}" if name else type(obj).__name__


def _check(obj: Any, comm: MPI.Comm, inner: int | None) -> MPI.Intracomm | None:
    """Refuse what cannot be managed on ``comm``. Returns None if ``obj`` is
    serial or lives on ``comm`` itself (PETSc's inner duplicate of it), else
    the communicator it lives on, congruent with or a subset of ``comm``."""
    if not isinstance(obj, PETSc.Object):
        raise RegistrationError(
            f"collective_gc.petsc.manage() manages petsc4py objects, not a "
            f"{type(obj).__name__!r} object (use collective_gc.register for other resources)"
        )
    if not obj.handle:
        raise RegistrationError(
            f"this {type(obj).__name__} is destroyed or was never created; "
            "create it before handing it to collective_gc.petsc.manage()"
        )
    ocomm = obj.getComm()
    osize = ocomm.getSize()
    if osize == 1:
        return None  # a serial object: destroying it at a sync point of any communicator is safe
    # PETSc keeps the object on its inner duplicate of the communicator it was
    # created with: of comm itself, or of a library's duplicate of it
    # (DOLFINx: each mesh's, and each IndexMap's), which Python sees only there.
    where = MPI.Intracomm(ocomm.tompi4py())
    if _internals.READER is not None and inner is not None and MPI._handleof(where) == inner:
        return None
    if contains(MPI.Intracomm(comm), where):
        return where
    raise RegistrationError(
        f"this {_describe_object(obj)} lives on a communicator of size {osize} whose "
        f"processes are not all in the communicator of size {comm.Get_size()} it is being "
        f"registered on (MPI_Comm_compare: {relation(where, comm)}); pass comm= a "
        "communicator that contains every process of it: the one it was created on "
        "(obj.getComm().tompi4py() is PETSc's duplicate of that), or COMM_WORLD"
    )


def manage(owner: object, *objs: Any, comm: MPI.Comm, name: str | None = None) -> Registration:
    """Destroy petsc4py ``objs`` at a sync point on ``comm`` once ``owner`` has died.

    Collective over ``comm``, like :func:`collective_gc.register` (which it
    calls): every rank manages the same wrappers in the same order; a rank that
    does not makes the next sync point raise ``CollectiveMismatchError``.

    ``owner`` is the wrapper that holds the objects (a solver class, a cache
    entry); it may sit in reference cycles and die in either collector, on any
    rank, at any time: that only queues the destroy. The objects are destroyed
    with ``.destroy()``, last first, at the first sync point on ``comm`` at
    which every rank has queued them, on every rank in the same order. If one
    raises on any rank, every other destroy still runs and
    ``collective_gc.DestroyError`` is raised on every rank, naming the
    exception that made it fail; if it was a parallel object, PETSc's objects
    on ``comm`` may now differ between ranks, and later sync points on
    ``comm`` refuse to run, saying so. Destroying an object yourself before then is
    fine: petsc4py nulls its handle, and the managed destroy skips it.

    The objects must live on ``comm`` (the communicator they were created
    with), on a communicator congruent with it or a subset of it (a
    library's own duplicate, as each DOLFINx mesh and IndexMap has: PETSc
    keeps the objects on its inner duplicate of that), or be serial (size 1).
    Their destroys run at ``comm``'s sync points; PETSc's garbage on their own
    communicators is cleaned there too (those are reached as derived
    communicators). The registration keeps them alive until
    then, so they must not refer back to ``owner``: an application context,
    a callback that is a method of the owner or an attribute set with
    ``setAttr`` would keep the owner alive for ever (use a weak reference
    there). An object that already refers back to ``owner`` is refused
    with :class:`~collective_gc.RegistrationError`, naming the path; for a
    reference made later, :func:`immortal`, ``cgc.view``, the leak check and
    a warning at exit name such owners and the path back to them. Also
    installs the PETSc garbage hook on ``comm`` (see :func:`install`).
    Returns the registration (``.destroy()`` destroys now, collectively;
    ``.detach()`` leaves the objects to you).
    """
    if not objs:
        raise RegistrationError("collective_gc.petsc.manage() needs at least one petsc4py object")
    # The common case, from C: the communicator of the last call, installed
    # (its cleanup still among the family's participants), and objects that
    # PETSc's own classes destroy, on its inner communicator or serial, with
    # nothing in Python they refer to. Whether the manager can register now
    # is register()'s to say, as on every path.
    # (Read in one step: another thread's call may store between two reads,
    # and one of this communicator with another's manager registers there.)
    ref, last_mgr, fam, cleanup = _LAST
    if NATIVE is not None and ref is not None and ref() is comm:
        mgr: Manager = last_mgr
        if cleanup in fam.participants:
            kind = NATIVE.sort(objs, comm)
            if kind >= 0:
                state = SERIAL if kind else cleanup.state
                if name is None:
                    name = type(owner).__name__
                if len(objs) == 1:
                    return mgr.register(owner, destroy_one, (objs[0], state), _NO_KWARGS, name)
                return mgr.register(owner, destroy_many, (state, *objs), _NO_KWARGS, name)
    mgr = install(comm)
    reader = _internals.READER
    inner = None if reader is None else reader.inner(comm)
    serial = True
    elsewhere: dict[int, MPI.Intracomm] = {}
    for obj in objs:
        where = _check(obj, comm, inner)
        if where is not None:
            elsewhere.setdefault(MPI._handleof(where), where)
        serial = serial and obj.getComm().getSize() == 1
    for where in elsewhere.values():
        # PETSc bins the garbage of these objects' other Python references
        # on their own communicator: clean it there too, at comm's sync
        # points (its family's, when it is congruent with comm; else a
        # derived family's, which comm's sync points reach).
        adopt(mgr, install(where))
    cleanup = cleanup_of(mgr)
    assert cleanup is not None  # install(comm) above
    state = SERIAL if serial else cleanup.state
    # (The owner itself among objs is register()'s to refuse.) Most objects
    # have no Python attributes at all: nothing to walk.
    roots = [(type(obj).__name__, obj) for obj in objs if obj is not owner]
    path = None
    if any(gc.get_referents(obj) for _, obj in roots):
        path, _ = path_to(roots, owner, 1000)
    if path is not None:
        raise RegistrationError(
            f"this {type(owner).__name__} is referred to by an object it hands to "
            f"collective_gc.petsc.manage() ({path}), and the registration holds that "
            "object until the owner dies, so it would never die; refer to the owner "
            "through a weakref.proxy there"
        )
    if name is None:
        name = type(owner).__name__
    if len(objs) == 1:
        reg = register(owner, destroy_one, objs[0], state, comm=comm, name=name)
    else:
        reg = register(owner, destroy_many, state, *objs, comm=comm, name=name)
    fam = family(mgr)
    if fam is not None and not elsewhere:
        _LAST[:] = [weakref.ref(comm), mgr, fam, cleanup]
    return reg


# manage()'s last communicator (a weak reference: it may be a managed one),
# its manager, family and PETSc cleanup participant: what the next call on it
# checks before taking the C path.
_LAST: list[Any] = [None, None, None, None]
_NO_KWARGS: dict[str, Any] = {}


# -- solves as sync points -----------------------------------------------------


def _solve(solver: Any, *args: Any) -> Any:
    return solver.solve(*args)


def solve(solver: Any, *args: Any, comm: MPI.Comm | None = None) -> Any:
    """Collective: ``solver.solve(*args)`` (a KSP or SNES), then a sync point.

    The sync point is the innermost open ``collective_scope`` of this thread
    (on ``comm``, if given), or ``cgc.collect(comm)`` with no scope open. So
    every rank must call it, as it must call the solve. If the solve raises,
    no sync point runs. For a wrapper class, decorating its own solve method
    with ``@collective_gc.sync_point`` does the same.
    """
    fn: Callable[..., Any] = sync_point(_solve, comm=comm)
    return fn(solver, *args)
