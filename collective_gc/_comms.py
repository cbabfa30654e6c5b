"""Derived communicators: ``dup`` and ``split``, and those a library makes.

A communicator is itself a collective resource: freeing it is collective over
its group, and a program that duplicates one per solve and never frees them
runs out of communicators (Firedrake #2669: near 2,036 meshes). Python's GC
never frees an mpi4py communicator, and freeing one from a finalizer or an MPI
attribute delete callback is the hazard this library exists to remove.

``dup``/``split`` make the new communicator a registration on the parent's
manager, so it is freed at a sync point of the parent, in the agreed order,
once every rank has dropped it and nothing registered on it is left.

What reaches a derived communicator's registrations depends on its group:

- *congruent* with its parent (a ``dup``, a ``split`` with one colour, a
  library's ``comm.Dup()``, PETSc's inner duplicates): it joins the parent's
  family (:mod:`collective_gc._collective`), so its registrations ride the
  parent's agreement, in the same collective: no duplicate, no agreement and
  no sync point of its own, whatever the number of such communicators;
- a *strict subset* (a ``split``, a library's ``Split``): its own family,
  with its own agreement, a *child* of the parent's family, whose sync
  points visit it when one of its ranks has something for it (a bit of the
  parent's agreement says so: alike on all its ranks). A visit costs one
  collective of the child; a child with nothing to do costs nothing.

A library's communicator joins a family at its first collective (collective
over it, so at the same point of the program on each of its ranks) if one
is congruent with it; otherwise its new family becomes a child of the
innermost open scope's family, or else of ``COMM_WORLD``'s if that was used,
when that family's group contains its group. A family of size > 1 that no
parent contains when it is made is named (see :func:`unreached`) and
adopted by the next sync point of a family that contains it.
"""

from __future__ import annotations

import warnings
import weakref

from mpi4py import MPI

from . import _interrupts, _manager, _tree
from ._api import register
from ._collective import Collective, families
from ._errors import CollectiveGCError
from ._lookup import lookup, manager
from ._manager import Manager, set_first_collective
from ._scope import current_scope
from ._tree import link, reaches

__all__ = ["dup", "split", "derived", "contains", "relation", "unreached", "adopt"]

_RECORD_KEYVAL: list[int] = []


def _record_deleted(comm: MPI.Comm, keyval: int, record: _Owned) -> None:
    # An MPI attribute delete callback: record only, never call MPI here.
    record.handle_freed = True


def _keyval() -> int:
    if not _RECORD_KEYVAL:
        _RECORD_KEYVAL.append(MPI.Comm.Create_keyval(delete_fn=_record_deleted))
    return _RECORD_KEYVAL[0]


def contains(parent: MPI.Intracomm, child: MPI.Intracomm) -> bool:
    """Whether every process of ``child`` is in ``parent`` (congruent, or a
    subset). Local: groups are compared, no message."""
    if MPI.Comm.Compare(parent, child) in (MPI.IDENT, MPI.CONGRUENT):
        return True
    return _tree.ranks_in(parent, child) is not None


def relation(a: MPI.Comm, b: MPI.Comm) -> str:
    """How two communicators compare, in words (MPI_Comm_compare). Local."""
    result = MPI.Comm.Compare(a, b)
    return {
        MPI.IDENT: "identical",
        MPI.CONGRUENT: "congruent",
        MPI.SIMILAR: "similar",
    }.get(result, "unequal")


class _Owned:
    """A communicator ``dup``/``split`` made, on this rank: freed by us once
    dropped on every rank (its registration's destroy, agreed) and nothing
    registered on it is left."""

    __slots__ = ("handle", "label", "mgr", "fam", "dropped", "released", "handle_freed")

    def __init__(self, handle: MPI.Intracomm, label: str, mgr: Manager, fam: Collective) -> None:
        # Our own wrapper of the handle: the user's object is the one whose
        # death we watch, so we must not hold it.
        self.handle: MPI.Intracomm | None = handle
        self.label = label
        self.mgr: Manager | None = mgr
        self.fam = fam  # where its own registrations are agreed (the parent's, or a child)
        self.dropped = False
        self.released = False
        self.handle_freed = False

    def drop(self) -> None:
        """The destroy of the user's communicator object: agreed, so every rank
        of the parent runs it, at the same point. Freed now if nothing is
        registered on it, else once its family's sync point finds it empty."""
        self.dropped = True
        if not self.try_free():
            self.fam.leave_later(self.try_free, agreed=True)

    def try_free(self) -> bool:
        """Free the communicator if nothing is registered on it (the count is
        the same on every rank of it after agreed destroys). True if done."""
        if self.released:
            return True
        mgr = self.mgr
        if mgr is not None and mgr.state is _OPEN and mgr.registered:
            return False
        handle = self.handle
        if handle is not None and not self.handle_freed:
            # Its manager is told by its attribute delete callback and leaves
            # its family (see _manager.comm_was_freed): an agreed free.
            if mgr is not None:
                _manager.freeing_agreed(mgr)
            handle.Free()
        self.handle = None
        self.mgr = None
        self.released = True
        return True

    def __repr__(self) -> str:
        state = "released" if self.released else "dropped" if self.dropped else "in use"
        return f"<collective_gc derived communicator {self.label}: {state}>"


_OPEN = _manager.State.OPEN


def derived(comm: MPI.Intracomm) -> list[str]:
    """Labels of the derived communicators of ``comm``'s family not yet let go
    of on this rank: its ``dup``\\s (and one-colour ``split``\\s) still alive,
    and its child families (strict subsets). Local."""
    mgr = lookup(comm)
    fam = None if mgr is None else _manager.family(mgr)
    if fam is None:
        return []
    out = []
    kv = _keyval()
    for _, member in fam.live_members():
        if member.comm_freed:
            continue
        try:
            record = member.comm.Get_attr(kv)
        except CollectiveGCError:
            continue
        if isinstance(record, _Owned) and not record.released:
            out.append(record.label)
    out.extend(c.label for c in _tree.children_of(fam) if not c.done())
    return out


def _owned_record(new: MPI.Intracomm, label: str, mgr: Manager, fam: Collective) -> _Owned:
    _manager.set_label(mgr, label)
    record = _Owned(MPI.Intracomm(new), label, mgr, fam)
    new.Set_attr(_keyval(), record)
    return record


def dup(comm: MPI.Intracomm) -> MPI.Intracomm:
    """Collective over ``comm``: a duplicate freed by collective_gc, not by you.

    When every rank has dropped the returned communicator, it is freed at a
    sync point of ``comm`` (after anything registered on it is destroyed),
    or at exit. Do not ``Free()`` it yourself while it is still registered
    (that would be seen and not freed twice, but it wastes nothing to let it be).
    It shares ``comm``'s sync points (it is congruent with it): it holds no
    other communicator, and costs nothing at a sync point.
    """
    parent = manager(comm)
    parent.refuse_if_unusable("make a derived communicator")  # before it is made
    # One protected region: a signal's handler runs once every rank has made
    # it (and made the parent's first collective, if this is it).
    entered = _interrupts.enter()
    try:
        fam = _manager.open_family(parent)
        new = MPI.Intracomm(comm.Dup())
        return _adopt_congruent(parent, fam, new, f"dup #{_made(fam)} of a {parent.describe()}")
    finally:
        _interrupts.leave(entered)


_MADE: weakref.WeakKeyDictionary[Collective, list[int]] = weakref.WeakKeyDictionary()


def _made(fam: Collective) -> int:
    # How many derived communicators this family's ranks made, for labels.
    count = _MADE.setdefault(fam, [0])
    count[0] += 1
    return count[0] - 1


def _adopt_congruent(
    parent: Manager, fam: Collective, new: MPI.Intracomm, label: str
) -> MPI.Intracomm:
    child = manager(new)
    _manager.join(child, fam)
    record = _owned_record(new, label, child, fam)
    try:
        register(new, record.drop, comm=parent.comm, name=label)
    except BaseException:
        # Refused here (another thread registering at that moment, say):
        # nothing is left behind, the new communicator included.
        record.handle = None
        record.released = True
        new.Free()
        raise
    return new


def split(comm: MPI.Intracomm, color: int, key: int = 0) -> MPI.Intracomm:
    """Collective over ``comm``: ``comm.Split(color, key)``, freed by collective_gc.

    As :func:`dup`. A rank that passes ``MPI.UNDEFINED`` gets ``MPI.COMM_NULL``
    (still registered, so the parent's keys stay the same on every rank). A
    split with one colour (every rank in the same order) shares ``comm``'s
    sync points, as a :func:`dup`; a strict subset has sync points of its
    own, run by ``comm``'s when one of its ranks has something for them.
    """
    parent = manager(comm)
    parent.refuse_if_unusable("make a derived communicator")  # before it is made
    entered = _interrupts.enter()  # as dup's
    try:
        return _split(parent, comm, color, key)
    finally:
        _interrupts.leave(entered)


def _split(parent: Manager, comm: MPI.Intracomm, color: int, key: int) -> MPI.Intracomm:
    fam = _manager.open_family(parent)
    new = MPI.Intracomm(comm.Split(color, key))
    member = new != MPI.COMM_NULL
    whole = member and new.Get_size() == comm.Get_size()
    # Alike on every rank: whole on one rank means every rank is in it, and
    # comparing the two groups gives the same answer everywhere.
    congruent = whole and MPI.Comm.Compare(new, comm) in (MPI.IDENT, MPI.CONGRUENT)
    label = f"split #{_made(fam)} (color {color}) of a {parent.describe()}"
    if congruent:
        return _adopt_congruent(parent, fam, new, label)
    record = None
    if member:
        child = manager(new)
        try:
            # Its family and private duplicate now, with the communicator
            # (collective over it anyway): then whether the parent's sync
            # points reach it is the same on all its ranks, and a registration
            # on it makes no collective, so one rank registering alone is a
            # mismatch at its next sync point, not a rank waiting.
            cfam = _manager.open_family(child)
        except BaseException:
            new.Free()
            raise
        record = _owned_record(new, label, child, cfam)
        link(fam, cfam, new, label)
    try:
        register(new, record.drop if record is not None else _nothing, comm=comm, name=label)
    except BaseException:
        if record is not None:
            record.handle = None
            record.released = True
            new.Free()
        raise
    return new


def _nothing() -> None:
    """The destroy of a rank's ``MPI.COMM_NULL`` from :func:`split`."""


def adopt(parent: Manager, child: Manager) -> bool:
    """Let ``parent``'s sync points reach ``child``'s registrations: True if
    they do now (``child``'s communicator is congruent with ``parent``'s, or
    a strict subset of it whose family became a child of ``parent``'s), False
    if they cannot (it is not inside). Collective over ``child``'s
    communicator (it may make its first collective)."""
    if child.state is not _OPEN or parent.state is not _OPEN:
        return False
    try:
        comm, pcomm = child.comm, parent.comm
    except CollectiveGCError:
        return False  # freed: nothing more can reach it
    if not contains(pcomm, comm):
        return False
    pfam = _manager.open_family(parent)
    cfam = _manager.open_family(child)
    if cfam is pfam or reaches(pfam, cfam):
        return True
    label = (
        f"a {relation(comm, pcomm)} communicator of size {child.size} reached from the "
        f"{parent.describe()}"
    )
    if link(pfam, cfam, comm, label):
        _tree.forget_unreached(cfam)
        return True
    return False


_WARNED: weakref.WeakSet[Collective] = weakref.WeakSet()


def _parent_for(mgr: Manager) -> Collective | None:
    # The innermost open scope's family, else COMM_WORLD's if it was used
    # collectively (both alike on every rank: scopes are entered collectively,
    # registrations and sync points are collective).
    candidates = []
    scope = current_scope()
    if scope is not None:
        candidates.append(_manager.family(scope.manager))
    world = lookup(MPI.COMM_WORLD)
    if world is not None:
        candidates.append(_manager.family(world))
    for fam in candidates:
        if fam is not None and fam.core.comm is not None and fam.core.reason is None:
            return fam
    return None


def _first_collective(mgr: Manager, new: bool) -> None:
    """At a manager's first collective (every rank of its communicator at the
    same point): a new family of size > 1 (nothing congruent with it existed)
    is reached by a containing family's sync points, or named unreached."""
    if not new:
        return
    fam = _manager.family(mgr)
    if fam is None:
        return
    _tree.made(fam)
    try:
        comm = mgr.comm
    except CollectiveGCError:
        return
    if isinstance(comm.Get_attr(_keyval()), _Owned):
        return  # made by split: linked there
    if mgr.size == 1:
        # A library's part of one process (Split(rank, 0)) made inside a
        # scope is reached by the scope's sync points, as cgc.split's is;
        # outside one (and COMM_SELF itself, which no library makes) it keeps
        # sync points of its own, as a program expects of COMM_SELF's.
        # (Its first use is rank-local: the scope's family, if not made yet,
        # cannot be made here; its next sync point adopts it, see _tree.reach.)
        scope = current_scope()
        if scope is None or MPI.Comm.Compare(comm, MPI.COMM_SELF) == MPI.IDENT:
            return
        parent = _manager.family(scope.manager)
        if parent is None:
            _tree.add_unreached(fam, mgr, families())
        elif parent is not fam and parent.core.reason is None:
            link(parent, fam, comm, f"a communicator of size 1 reached from a {parent.label}")
        return
    parent = _parent_for(mgr)
    if parent is not None and parent is not fam:
        label = f"a communicator of size {mgr.size} reached from a {parent.label}"
        if link(parent, fam, comm, label):
            return
    if comm != MPI.COMM_WORLD:
        # (Its private duplicate carries the barrier that says every rank
        # listed it: it has just made its first collective there.)
        _tree.add_unreached(fam, mgr, families(), fam.core.comm)


set_first_collective(_first_collective)


def unreached(warn: bool = True) -> list[Manager]:
    """Managers of communicators of size > 1 with registrations that no
    parent's sync point reaches yet and that never ran a sync point of their
    own: their destroys wait for one (a sync point of a communicator that
    contains theirs, ``cgc.collect(comm)`` on them) or for exit. Local. The
    first time each is named here (or by the pytest plugin's leak check; ``cgc.view``
    lists them without warning), a RuntimeWarning names it; the list is made from
    collective state, so on every rank of it alike (``warn=False``: no warning)."""
    out = []
    for fam, mgr in _tree.unreached_families():
        if fam.core.live and fam.core.seq == 0 and fam.core.reason is None:
            out.append(mgr)
            if warn and fam not in _WARNED:
                _WARNED.add(fam)
                warnings.warn(
                    f"collective_gc: rank {mgr.rank}: {len(fam.core.live)} registration(s) "
                    f"on a {mgr.describe()} that no sync point reaches: it was first used "
                    "outside any collective_scope whose communicator contains it, and "
                    "COMM_WORLD's manager was not in use; a sync point of a communicator "
                    "that contains it, or cgc.collect on it, reaches it",
                    RuntimeWarning,
                    stacklevel=2,
                )
    return out


def unreached_rows(mgr: Manager) -> list[tuple[str, str]]:
    """In ``cgc.view`` of any communicator: this rank's unreached managers."""
    return [("unreached", _unreached_text(m)) for m in unreached(warn=False) if m is not mgr]


def _unreached_text(mgr: Manager) -> str:
    fam = _manager.family(mgr)
    n = 0 if fam is None else len(fam.core.live)
    return f"{n} registered on a {mgr.describe()} that no sync point reaches"
