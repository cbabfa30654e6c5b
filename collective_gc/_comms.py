"""Derived communicators: ``dup`` and ``split``, and those a library makes.

A communicator is itself a collective resource: freeing it is collective over
its group, and a program that duplicates one per solve and never frees them
runs out of communicators (Firedrake #2669: near 2,036 meshes). Python's GC
never frees an mpi4py communicator, and freeing one from a finalizer or an MPI
attribute delete callback is the hazard this library exists to remove.

``dup``/``split`` make the new communicator a registration on the parent's
manager, so it is freed at a sync point of the parent, in the agreed order,
once every rank has dropped it. The parent's sync points first visit each
derived communicator (in creation order, which is the same on every rank, so
ranks that share several derived communicators visit them in the same order
and ranks outside one skip it): they run a sync point of its manager and free
it once it has been dropped and nothing registered on it is left. Otherwise
it stays, and is tried again at the parent's next sync point.

Communicators a library makes (DOLFINx's ``comm.Dup()`` of each mesh,
PETSc's inner duplicates that its objects hold) are reached the same way: at
the first collective of a manager on one (collective over it, so at the same
point of the program on each of its ranks) it is *adopted* by the innermost
open scope's communicator, or else by ``COMM_WORLD``'s manager if that was
used, when that communicator's group contains its group (congruent, or a
subset). An adopted communicator is not ours to free: once nothing is
registered on its manager (and, with PETSc's garbage cleanup installed, once
its owner freed it), the parent's sync point lets go of the manager, freeing
its private duplicate, on every rank of it at the same visit. A manager with
registrations that nothing adopts is named: see :func:`unreached`.

Whether a visit syncs a derived communicator must be decided alike on its
ranks. It is decided by whether its manager exists, which is itself
collective (``dup``/``split`` make it, with its private duplicate, as they
make the communicator; adoption happens at a collective): so one rank
registering what the others do not is a :class:`CollectiveMismatchError` of
the child's agreement, on every rank at once (issue 25, defect 7), never one
rank waiting alone in it.
"""

from __future__ import annotations

import warnings
import weakref

from mpi4py import MPI

from ._api import register
from ._destroy import Failure
from ._errors import (
    CollectiveGCError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DestroyError,
)
from ._lookup import lookup, manager, on_first_collective, on_new_manager, retire
from ._manager import Manager
from ._scope import current_scope

__all__ = ["dup", "split", "derived", "adopt", "contains", "relation", "unreached"]

_CHILD_KEYVAL: list[int] = []
# Which manager's sync points reach a manager (to refuse a cycle of visits).
_PARENT: weakref.WeakKeyDictionary[Manager, Manager] = weakref.WeakKeyDictionary()


def _child_deleted(comm: MPI.Comm, keyval: int, record: _Derived) -> None:
    # An MPI attribute delete callback: record only, never call MPI here.
    record.handle_freed = True


def _keyval() -> int:
    if not _CHILD_KEYVAL:
        _CHILD_KEYVAL.append(MPI.Comm.Create_keyval(delete_fn=_child_deleted))
    return _CHILD_KEYVAL[0]


def contains(parent: MPI.Intracomm, child: MPI.Intracomm) -> bool:
    """Whether every process of ``child`` is in ``parent`` (congruent, or a
    subset). Local: groups are compared, no message."""
    if MPI.Comm.Compare(parent, child) in (MPI.IDENT, MPI.CONGRUENT):
        return True
    pg, cg = parent.Get_group(), child.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(cg, list(range(cg.Get_size())), pg)
        return MPI.UNDEFINED not in ranks
    finally:
        pg.Free()
        cg.Free()


def relation(a: MPI.Comm, b: MPI.Comm) -> str:
    """How two communicators compare, in words (MPI_Comm_compare). Local."""
    result = MPI.Comm.Compare(a, b)
    return {
        MPI.IDENT: "identical",
        MPI.CONGRUENT: "congruent",
        MPI.SIMILAR: "similar",
    }.get(result, "unequal")


class _Derived:
    """This rank's record of one derived communicator of a parent manager.

    ``owned``: made by :func:`dup`/:func:`split`, freed by us once dropped;
    else adopted (a library's), never freed by us. ``whole``: it holds every
    rank of the parent, so an error of its sync point is raised as is on
    every rank of the parent (else it is reported through the parent's).
    """

    __slots__ = (
        "handle",
        "label",
        "owned",
        "whole",
        "mgr",
        "dropped",
        "released",
        "handle_freed",
        "__weakref__",
    )

    def __init__(self, handle: MPI.Intracomm | None, label: str, owned: bool, whole: bool) -> None:
        # Our own wrapper of the handle: the user's object is the one whose
        # death we watch, so we must not hold it.
        self.handle = handle
        self.label = label
        self.owned = owned
        self.whole = whole
        self.mgr: Manager | None = None
        self.dropped = False
        self.released = False
        self.handle_freed = False

    def drop(self) -> None:
        """The destroy of the user's communicator object: agreed, so every rank runs it."""
        self.dropped = True
        self._try_release()

    def visit(self, deadline: float | None) -> list[Failure]:
        """Collective over the derived communicator: sync its manager, free it if done."""
        failures: list[tuple[int, str, BaseException]] = []
        mgr = self.mgr
        # Its manager exists on every rank of it or on none (made collectively,
        # let go of collectively at a visit), so every rank syncs it or skips it.
        if mgr is not None and mgr.broken is None:
            # Whatever this sync point raises becomes a failure of the
            # parent's sync point, which the parent's agreement tells every
            # rank of the parent (ranks outside this communicator too), so
            # they all raise together; raising here would leave the
            # parent's other ranks waiting in its header. A timeout still
            # propagates: the parent's other ranks have the same deadline.
            try:
                mgr.sync(deadline=deadline)
            except DestroyError as exc:
                failures.extend(
                    (key, f"{name} (on {self.label})", RuntimeError(msg))
                    for r, key, name, msg in exc.failures
                    if r == mgr.rank
                )
            except CollectiveTimeoutError:
                raise
            except CollectiveMismatchError as exc:
                # Every rank of this communicator saw it in the same agreement.
                error = CollectiveMismatchError(self._mismatch_text(mgr, exc))
                if self.whole:
                    raise error from None  # every rank of the parent is here too
                failures.append((-1, f"the sync point of {self.label}", error))
            except BaseException as exc:  # an interrupt is re-raised by the parent, later
                failures.append((-1, f"the sync point of {self.label}", exc))
        if self.owned:
            if self.dropped:
                self._try_release()
        else:
            self._let_go_if_done()
        try:
            return failures
        finally:
            del failures  # see _destroy.Failure

    def _mismatch_text(self, mgr: Manager, exc: CollectiveMismatchError) -> str:
        """The child's mismatch, with what each rank has registered on it.
        Collective over the child: every rank of it just left the same
        agreement with this error, so they all gather here."""
        mine = [(r.key, r.name) for r in sorted(mgr.alive() + mgr.pending(), key=lambda r: r.key)]
        handle = self.handle
        if handle is None or self.handle_freed:
            everyone = None
        else:
            everyone = handle.allgather(mine[-5:])
        text = f"on {self.label}, reached from a sync point of its parent: {exc}"
        if everyone is not None:
            shown = "; ".join(
                f"rank {r}: "
                + (", ".join(f"key {k} ({n!r})" for k, n in regs) if regs else "nothing")
                for r, regs in enumerate(everyone)
            )
            text += f" Registered there (the newest, by rank of {self.label}): {shown}."
        return text

    def _try_release(self) -> None:
        handle = self.handle
        if handle is not None and not self.handle_freed:
            mgr = self.mgr
            if mgr is not None and mgr.broken is None and mgr.registered:
                # Still in use. The count left is the same on every rank of
                # the derived communicator after its sync point (registration
                # is collective and destroys are agreed), so they all wait.
                # An unusable one (its ranks disagreed, on all of them) will
                # never destroy what is left: that is leaked, and it is freed.
                return
            # Its manager is told by its attribute delete callback and lets
            # go of its private duplicate at the next safe point.
            handle.Free()
        self.handle = None
        self.mgr = None
        self.released = True

    def _let_go_if_done(self) -> None:
        # An adopted communicator: its manager goes once nothing is registered
        # there (the same count on every rank of it after its sync point).
        # With participants (PETSc's garbage cleanup), garbage may still come
        # while the communicator lives: then it goes once its owner freed it.
        mgr = self.mgr
        if mgr is not None and mgr.broken is None:
            if mgr.registered or (mgr.participants and not mgr.comm_freed):
                return
            freed = self.handle_freed or mgr.comm_freed
            if not retire(mgr, None if freed else self.handle):
                return
        handle = self.handle
        if handle is not None and not self.handle_freed:
            handle.Delete_attr(_keyval())  # no longer ours to visit
        self.handle = None
        self.mgr = None
        self.released = True

    def __repr__(self) -> str:
        state = "released" if self.released else "dropped" if self.dropped else "in use"
        return f"<collective_gc derived communicator {self.label}: {state}>"


class _Children:
    """The communicators derived from one parent, visited first at each of its
    sync points (their resources are newer, and may have to go before one of
    the parent's can), in creation order: the parent manager's visitor.

    Not a participant: ranks of the parent inside and outside a subset
    communicator have different records, and nothing of them enters the
    parent's agreement but the failures of the visits."""

    __slots__ = ("records", "made")

    def __init__(self) -> None:
        self.records: list[_Derived] = []
        self.made = 0

    def __call__(self, mgr: Manager, deadline: float | None) -> list[Failure]:
        if _UNREACHED:
            _reach(mgr)
        records = self.records
        if not records:
            return _NO_FAILURES
        failures: list[Failure] = []
        # Those dropped at the last sync point were released by their destroys.
        for record in [r for r in records if not r.released]:
            failures.extend(record.visit(deadline))
        self.records = [r for r in records if not r.released]
        return failures


_NO_FAILURES: list[Failure] = []  # never appended to: returned by visits that found nothing
# Each parent manager's children (the value is also the manager's visitor).
_CHILDREN: weakref.WeakKeyDictionary[Manager, _Children] = weakref.WeakKeyDictionary()


def _children(parent: Manager) -> _Children:
    children = _CHILDREN.get(parent)
    if children is None:
        children = _CHILDREN[parent] = _Children()
        parent.set_visitor(children)
    return children


def derived(comm: MPI.Intracomm) -> list[str]:
    """Labels of the derived communicators of ``comm`` not yet let go of. Local."""
    mgr = lookup(comm)
    if mgr is None:
        return []
    children = _CHILDREN.get(mgr)
    return [] if children is None else [r.label for r in children.records if not r.released]


def _adopt(
    children: _Children, new: MPI.Intracomm, comm: MPI.Intracomm, label: str
) -> MPI.Intracomm:
    member = new != MPI.COMM_NULL
    whole = member and new.Get_size() == comm.Get_size()
    record = _Derived(MPI.Intracomm(new) if member else None, label, owned=True, whole=whole)
    if member:
        new.Set_attr(_keyval(), record)
    children.records.append(record)
    children.made += 1
    try:
        register(new, record.drop, comm=comm, name=label)
        if member:
            # Its manager and private duplicate now, with the communicator
            # (collective over it anyway): then whether the parent's sync
            # points sync it is the same on all its ranks, and a registration
            # on it makes no collective, so one rank registering alone is a
            # mismatch at the next sync point, not a rank waiting (defect 7).
            child = manager(new)
            _PARENT[child] = manager(comm)
            child.sync()
            record.mgr = child
    except BaseException:
        # Refused here (another thread registering at that moment, say):
        # nothing is left behind, the new communicator included.
        children.records.remove(record)
        if member:
            record.handle = None
            new.Free()
        raise
    return new


def dup(comm: MPI.Intracomm) -> MPI.Intracomm:
    """Collective over ``comm``: a duplicate freed by collective_gc, not by you.

    When every rank has dropped the returned communicator, it is freed at a
    sync point of ``comm`` (after anything registered on it is destroyed),
    or at exit. Do not ``Free()`` it yourself while it is still registered
    (that would be seen and not freed twice, but it wastes nothing to let it be).
    Each sync point of ``comm`` runs one of the duplicate's while it lives.
    """
    parent = manager(comm)
    parent.refuse_if_unusable("make a derived communicator")  # before it is made
    children = _children(parent)
    new = MPI.Intracomm(comm.Dup())
    return _adopt(children, new, comm, f"dup #{children.made} of a {parent.describe()}")


def split(comm: MPI.Intracomm, color: int, key: int = 0) -> MPI.Intracomm:
    """Collective over ``comm``: ``comm.Split(color, key)``, freed by collective_gc.

    As :func:`dup`. A rank that passes ``MPI.UNDEFINED`` gets ``MPI.COMM_NULL``
    (still registered, so the parent's keys stay the same on every rank).
    """
    parent = manager(comm)
    parent.refuse_if_unusable("make a derived communicator")  # before it is made
    children = _children(parent)
    new = MPI.Intracomm(comm.Split(color, key))
    label = f"split #{children.made} (color {color}) of a {parent.describe()}"
    return _adopt(children, new, comm, label)


# -- communicators a library made ------------------------------------------------


def _reaches(a: Manager, b: Manager) -> bool:
    """Whether ``a``'s sync points reach ``b`` (``b`` is ``a``, or a child of it
    or of one of its children...). Local, no MPI."""
    up: Manager | None = b
    while up is not None:
        if up is a:
            return True
        up = _PARENT.get(up)
    return False


def adopt(parent: Manager, child: Manager) -> bool:
    """Let ``parent``'s sync points reach ``child`` (a manager of a
    communicator congruent with, or a subset of, the parent's), as for a
    ``cgc.dup``; True if it was adopted now, False if something already
    reaches it or it cannot be (its communicator is not in the parent's).

    Collective in effect over ``child``'s communicator: every rank of it must
    adopt it at the same point between two sync points of the parent (its
    first collective is such a point; so is a collective registration).
    """
    if child is parent or child.broken is not None or parent.broken is not None:
        return False
    try:
        comm, pcomm = child.comm, parent.comm
    except CollectiveGCError:
        return False  # freed: nothing more can reach it
    kv = _keyval()
    if isinstance(comm.Get_attr(kv), _Derived) or not contains(pcomm, comm):
        return False
    if _reaches(child, parent):
        return False  # no cycle of visits
    children = _children(parent)
    label = (
        f"a {relation(comm, pcomm)} communicator of size {child.size} "
        f"(#{children.made}) reached from the {parent.describe()}"
    )
    record = _Derived(MPI.Intracomm(comm), label, owned=False, whole=child.size == parent.size)
    record.mgr = child
    comm.Set_attr(kv, record)
    _PARENT[child] = parent
    children.records.append(record)
    children.made += 1
    return True


# Managers with a collective that no parent adopted when it was made, in the
# order of their first collective (the same on every rank that shares them):
# the next sync point of a manager whose communicator contains theirs adopts
# them (see _reach); until then unreached() names them.
_UNREACHED: list[weakref.ref[Manager]] = []
_WARNED: weakref.WeakSet[Manager] = weakref.WeakSet()


def _reach(parent: Manager) -> None:
    """At a sync point of ``parent`` (before its children are visited): adopt
    the unreached managers its communicator contains. Every rank of such a
    communicator is a rank of the parent and runs this at the same point, with
    the same list (made at collectives), so they all adopt alike."""
    try:
        pcomm = parent.comm
    except CollectiveGCError:
        return
    keep = []
    for ref in _UNREACHED:
        child = ref()
        if child is not None and _reaches(child, parent):
            # The parent itself, or a manager whose sync points reach the
            # parent's (two dups of one communicator, say: the first one's
            # sync point adopted the other): never this parent's child, so
            # no group comparison at each of its sync points to find that
            # out again.
            keep.append(ref)
            continue
        if child is None or child.broken is not None or child.comm_freed:
            continue
        try:
            inside = contains(pcomm, child.comm)
        except CollectiveGCError:
            continue
        if not (inside and adopt(parent, child)):
            keep.append(ref)
    _UNREACHED[:] = keep


def _parent_for(mgr: Manager) -> Manager | None:
    # The innermost open scope's communicator, else COMM_WORLD's manager if it
    # was used collectively (both alike on every rank: scopes are entered
    # collectively, registrations and sync points are collective).
    candidates = []
    scope = current_scope()
    if scope is not None:
        candidates.append(scope.manager)
    world = lookup(MPI.COMM_WORLD)
    if world is not None and (world.next_key or world.sync_count):
        candidates.append(world)
    for parent in candidates:
        if parent is not mgr and parent.broken is None and not parent.comm_freed:
            try:
                if contains(parent.comm, mgr.comm):
                    return parent
            except CollectiveGCError:
                continue
    return None


def _first_collective(mgr: Manager) -> None:
    """At a manager's first collective (every rank of its communicator at the
    same point): every manager of size > 1 gets the visitor of derived
    communicators (it also adopts unreached ones: see _reach), and a
    communicator a library made is adopted by a parent's sync points."""
    if mgr.size == 1:
        return
    _children(mgr)
    try:
        comm = mgr.comm
    except CollectiveGCError:
        return
    if isinstance(comm.Get_attr(_keyval()), _Derived):
        return  # made by dup/split, or adopted already
    parent = _parent_for(mgr)
    if parent is None:
        if comm != MPI.COMM_WORLD:
            _UNREACHED.append(weakref.ref(mgr))
        return
    adopt(parent, mgr)


def _new_manager(mgr: Manager) -> None:
    # Local: the view and the leak check of any communicator name this rank's
    # unreached managers.
    mgr.add_view_hook(_unreached_rows)
    mgr.add_leak_hook(_unreached_lines)


on_first_collective(_first_collective)
on_new_manager(_new_manager)


def unreached(warn: bool = True) -> list[Manager]:
    """Managers of communicators of size > 1 with registrations that no
    parent's sync point reaches yet and that never ran a sync point of their
    own: their destroys wait for one (a sync point of a communicator that
    contains theirs, ``cgc.collect(comm)`` on them) or for exit. Local. The
    first time each is named here (or by the pytest plugin's leak check; ``cgc.view``
    lists them without warning), a RuntimeWarning names it; the list is made from
    collective state, so on every rank of it alike (``warn=False``: no warning)."""
    out = []
    for ref in _UNREACHED:
        mgr = ref()
        if mgr is not None and mgr.registered and mgr.sync_count == 0 and mgr.broken is None:
            out.append(mgr)
    for mgr in out if warn else ():
        if mgr not in _WARNED:
            _WARNED.add(mgr)
            warnings.warn(
                f"collective_gc: rank {mgr.rank}: {mgr.registered} registration(s) on a "
                f"{mgr.describe()} that no sync point reaches: it was first used outside any "
                "collective_scope whose communicator contains it, and COMM_WORLD's manager "
                "was not in use; a sync point of a communicator that contains it, or "
                "cgc.collect on it, reaches it",
                RuntimeWarning,
                stacklevel=2,
            )
    return out


def _unreached_text(mgr: Manager) -> str:
    return f"{mgr.registered} registered on a {mgr.describe()} that no sync point reaches"


def _unreached_rows(mgr: Manager) -> list[tuple[str, str]]:
    # In cgc.view of any communicator: the unreached managers of this rank.
    return [("unreached", _unreached_text(m)) for m in unreached(warn=False) if m is not mgr]


def _unreached_lines(mgr: Manager) -> list[str]:
    return [_unreached_text(m) for m in unreached() if m is not mgr]
