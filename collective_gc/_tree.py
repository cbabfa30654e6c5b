"""The derived-family tree: which families' sync points reach which.

A family whose processes are a strict subset of another's (a ``cgc.split``,
a library's ``Split``) is that family's *child*: the parent's sync points
visit it when some rank of it has something for it (a bit of the parent's
agreement says so, alike on all its ranks). A family of size > 1 that no
parent contained when it was made is *unreached*: the next sync point of a
family whose group contains it adopts it (see :func:`reach`); until then
:func:`unreached` names it.

This module is the tree's one writer: a family's ``children`` and ``parent``,
the unreached list, and the copies of them its state reads
(:meth:`FamilyState.set_children <collective_gc._state.FamilyState.set_children>`,
the ``HOLD_REACH`` bit) change here and nowhere else. It knows families by
what they have (their state, members, ``sync``), not by importing
collective_gc._collective, which is above it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from mpi4py import MPI

from ._agree import child_bit
from ._errors import (
    CollectiveGCError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DestroyError,
)
from ._state import HOLD_GONE, HOLD_REACH, State

if TYPE_CHECKING:
    from ._collective import Collective
    from ._destroy import Failure
    from ._manager import Manager

__all__ = [
    "Child",
    "link",
    "reaches",
    "ranks_in",
    "add_unreached",
    "forget_unreached",
    "made",
    "orphan",
    "reach",
    "wanted",
    "visit",
    "children_of",
    "unreached_families",
]


def ranks_in(parent: MPI.Intracomm, child: MPI.Intracomm) -> tuple[int, ...] | None:
    """The ranks in ``parent`` of ``child``'s processes, or None if one is not in it."""
    pg, cg = parent.Get_group(), child.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(cg, list(range(cg.Get_size())), pg)
    finally:
        pg.Free()
        cg.Free()
    return None if MPI.UNDEFINED in ranks else tuple(int(r) for r in ranks)


class Child:
    """A derived family that is a strict subset of its parent's, on a rank
    of it: the parent's record of it (records exist only on the child's ranks)."""

    __slots__ = ("fam", "bit", "label")

    def __init__(self, fam: Collective, ident: tuple[int, ...], label: str) -> None:
        self.fam = fam
        # Its bit of the parent's children word: a hash of its ranks in the
        # parent, so the same on every rank of it.
        self.bit = child_bit(hash(ident) & ((1 << 64) - 1))
        self.label = label

    def owner(self) -> Manager | None:
        """The member whose sync point is the family's: the oldest usable one
        (members join at collectives, so the same one on every rank). Not
        the one it was reached through: a family outlives its first members
        (each step's split joins the family of the last, which is then
        freed), and holding one would keep it from being let go of."""
        for _, mgr in self.fam.live_members():
            if mgr.state is State.OPEN:
                return mgr
        return None

    def done(self) -> bool:
        """Gone on this rank (freed, or let go of): alike on all its ranks,
        since members leave at collectives."""
        return bool(self.fam.core.hold & HOLD_GONE)

    def visit(self, deadline: float | None) -> list[Failure]:
        """Collective over the child: its sync point. Whatever it raises
        becomes a failure of the parent's sync point, reported on every rank
        of the parent (raising here would leave the parent's other ranks,
        outside the child, behind); a timeout still propagates: the parent's
        other ranks have the same deadline."""
        fam = self.fam
        failures: list[Failure] = []
        kept: list[tuple[int, Failure]] = []  # what its sync point knows on this rank only
        owner = self.owner()
        if fam.core.reason is None and owner is not None:
            try:
                fam.sync(owner, deadline=deadline, sink=kept)
            except DestroyError as exc:
                failures.extend(
                    (key, f"{name} (on {self.label})", RuntimeError(msg))
                    for r, key, name, msg in exc.failures
                    if r == fam.rank
                )
                if not failures:  # other ranks' only: still the parent's to report
                    failures.append((-1, f"the sync point of {self.label}", exc))
            except CollectiveTimeoutError:
                raise
            except CollectiveMismatchError as exc:
                failures.append(
                    (-1, f"the sync point of {self.label}", CollectiveMismatchError(str(exc)))
                )
            except BaseException as exc:  # an interrupt is re-raised by the parent, later
                if not any(exc is e for _, (_, _, e) in kept):  # else it is among those below
                    failures.append((-1, f"the sync point of {self.label}", exc))
        failures.extend((key, f"{name} (on {self.label})", exc) for _, (key, name, exc) in kept)
        del kept
        try:
            return failures
        finally:
            del failures  # see _destroy.Failure

    def __repr__(self) -> str:
        return f"<collective_gc derived family {self.label}>"


def children_of(fam: Collective) -> list[Child]:
    """The child families ``fam``'s sync points reach, on this rank. Local."""
    return fam.children


def _publish(fam: Collective) -> None:
    # The copy the state reads, for its steady state's look at the children.
    fam.core.set_children(tuple(c.fam.core for c in fam.children))


def reaches(a: Collective, b: Collective) -> bool:
    """Whether ``a``'s sync points reach ``b`` (``b`` is ``a``, or a child of
    it or of one of its children...). Local, no MPI."""
    up: Collective | None = b
    while up is not None:
        if up is a:
            return True
        up = up.parent
    return False


def link(parent: Collective, child: Collective, comm: MPI.Intracomm, label: str) -> bool:
    """Make ``child`` a child family of ``parent`` (on this rank, one of the
    child's). True if linked now; False if it was already reached, or would
    reach ``parent`` itself (no cycle of visits)."""
    if child is parent or child.parent is not None or reaches(child, parent):
        return False
    pcomm = parent.core.comm
    ranks = None if pcomm is None else ranks_in(pcomm, comm)
    if ranks is None:
        return False
    child.parent = parent
    parent.children.append(Child(child, ranks, label))
    _publish(parent)
    return True


def wanted(fam: Collective) -> int:
    """The bits of the children this rank has something for (objects queued
    there, failures kept or members to let go, a registration since its last
    sync point, a participant that votes or has no quiet finish, a child of
    its own that wants a visit); those gone on this rank leave the list
    first (no visit would drop a closed one, and while it is listed the
    family's sync points are not steady). A sync point's prepare. Local."""
    children = fam.children
    if not children:
        return 0
    if any(c.done() for c in children):
        fam.children = [c for c in children if not c.done()]
        _publish(fam)
    bits = 0
    for child in fam.children:
        if child.fam.core.wants():
            bits |= child.bit
    return bits


def visit(fam: Collective, bits: int, deadline: float | None) -> list[Failure]:
    """The sync points of ``fam``'s children whose bits are in the agreed
    ``bits`` (each collective over its child: its ranks all saw the same
    bit), in the order they were made; then those gone leave the list. Two
    children whose bits collide are visited together: a visit that finds
    nothing costs one collective of that child, never a wrong result."""
    failures: list[Failure] = []
    for child in list(fam.children):
        if child.bit & bits:
            failures.extend(child.visit(deadline))
    if any(c.done() for c in fam.children):
        fam.children = [c for c in fam.children if not c.done()]
        _publish(fam)
    try:
        return failures
    finally:
        del failures


# Families of size > 1 that no parent reached when they were made, in the
# order of their first collective (the same on every rank that shares them):
# the next sync point of a family whose group contains theirs adopts them
# (see reach); until then unreached_families() names them.
_UNREACHED: list[tuple[weakref.ref[Collective], weakref.ref[Manager]]] = []


def add_unreached(fam: Collective, mgr: Manager, families: Iterable[Collective]) -> None:
    """``fam`` (first used through ``mgr``) was reached by nothing: every
    family's sync point looks through the list once (they may contain it).
    Local."""
    _UNREACHED.append((weakref.ref(fam), weakref.ref(mgr)))
    for other in families:
        if other is not fam and other.size > 1:
            other.core.set_hold(HOLD_REACH, True)


def made(fam: Collective) -> None:
    """``fam`` was just made: if unreached families wait, its sync points
    look through them too (they may contain one made before it: a library's
    part of one process, first used inside a scope whose family was made
    later, at its first sync point). Local."""
    if _UNREACHED and fam.size > 1:
        fam.core.set_hold(HOLD_REACH, True)


def orphan(fam: Collective, families: Iterable[Collective]) -> None:
    """``fam`` let go (every communicator of it freed or closed): its
    children, which its sync points reached, are unreached again, for the
    next sync point of a family that contains them to adopt (a library's
    Split made under a scope on a duplicate the library then frees is
    reached by the sync points of the communicator it duplicated). Local;
    at the same point on every rank of each child, as letting go is."""
    children, fam.children = fam.children, []
    _publish(fam)
    for child in children:
        if child.done() or child.fam.parent is not fam:
            continue
        child.fam.parent = None
        owner = child.owner()
        if owner is not None:
            add_unreached(child.fam, owner, families)


def forget_unreached(fam: Collective) -> None:
    """``fam`` was reached (adopted as a child): off the list. Local."""
    _UNREACHED[:] = [(f, m) for f, m in _UNREACHED if f() is not None and f() is not fam]


def reach(parent: Collective) -> None:
    """At a sync point of ``parent`` (before its agreement): adopt the
    unreached families its group contains. Every rank of such a family is a
    rank of the parent and runs this at the same point, with the same list
    (made at collectives), so they all adopt alike. What is left belongs to
    other families' groups: ``parent`` needs not look again until the list
    grows (its HOLD_REACH bit)."""
    parent.core.set_hold(HOLD_REACH, False)
    if not _UNREACHED or parent.core.comm is None:
        return
    keep = []
    for fref, mref in _UNREACHED:
        fam, owner = fref(), mref()
        if fam is None or owner is None or not fam.members or fam.core.reason is not None:
            continue
        if fam.parent is not None:
            continue  # reached meanwhile
        if reaches(fam, parent):
            keep.append((fref, mref))  # it reaches the parent: never its child
            continue
        try:
            comm = owner.comm
        except CollectiveGCError:
            continue
        label = f"a communicator of size {fam.size} reached from a {parent.label}"
        if not link(parent, fam, comm, label):
            keep.append((fref, mref))
    _UNREACHED[:] = keep


def unreached_families() -> list[tuple[Collective, Manager]]:
    """(family, the manager first used) of the unreached families still
    alive and not yet reached. Local."""
    out = []
    for fref, mref in _UNREACHED:
        fam, mgr = fref(), mref()
        if fam is not None and mgr is not None and fam.parent is None:
            out.append((fam, mgr))
    return out


def after_fork() -> None:
    """In a forked child nothing is reached from here."""
    _UNREACHED.clear()
