"""The derived-family tree: which families' sync points reach which.

A family whose processes are a strict subset of another's (a ``cgc.split``,
a library's ``Split``) is that family's *child*: the parent's sync points
visit it when some rank of it has something for it (a bit of the parent's
agreement says so, alike on all its ranks). A family of size > 1 that no
parent contained when it was made, or whose parent let go, is *unreached*: a
sync point of a family whose group contains it adopts it once every rank of
it is known to have listed it (see :class:`_Listed`); until then
:func:`unreached` names it.

This module is the tree's one writer: a family's ``children``, ``parent``
and ``reach_mark``, the unreached list, and the copies of them its state reads
(:meth:`FamilyState.set_children <collective_gc._state.FamilyState.set_children>`,
the ``HOLD_REACH`` bit) change here and nowhere else. It knows families by
what they have (their state, members, ``sync``), not by importing
collective_gc._collective, which is above it.
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from mpi4py import MPI

from ._agree import FLAG_UNRIPE, child_bit
from ._errors import (
    CollectiveGCError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DestroyError,
    in_place_of,
)
from ._state import HOLD_GONE, HOLD_REACH, State
from ._transport import ibarrier, mpi_usable, test_kept

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
    "opening",
    "orphan",
    "reach",
    "adopt",
    "Offer",
    "NO_OFFER",
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
                if isinstance(in_place_of(exc), CollectiveTimeoutError):
                    # A held interrupt raised in the timeout's place (see
                    # SyncPoint.run): the timeout's path, the interrupt raised.
                    raise
                if not any(exc is e for _, (_, _, e) in kept):  # else it is among those below
                    failures.append((-1, f"the sync point of {self.label}", exc))
        failures.extend((key, f"{name} (on {self.label})", exc) for _, (key, name, exc) in kept)
        # Emptied, not only unbound: the child's sync point's frame, which
        # the failures' tracebacks reach, holds the same list (its sink).
        kept.clear()
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
    # In the families' numbers' order, not in the order they were linked: a
    # parent's sync point visits its children in list order, each visit a
    # collective over the child, so two children sharing two processes must
    # be in one order on both. Linking is local (where each rank listed
    # them, see _Listed); the numbers are agreed, and each rank's families
    # have distinct numbers.
    bisect.insort(parent.children, Child(child, ranks, label), key=_number_of)
    _publish(parent)
    return True


def _number_of(child: Child) -> int:
    return child.fam.number


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


def visit(
    fam: Collective, bits: int, deadline: float | None, sink: list[tuple[int, Failure]], seq: int
) -> None:
    """The sync points of ``fam``'s children whose bits are in the agreed
    ``bits`` (each collective over its child: its ranks all saw the same
    bit), in the order they were made (their numbers'); then those gone
    leave the list. Each child's failures join ``sink`` (as sync point
    ``seq``'s) as its visit returns: a later child's timeout, raised, leaves
    them there (an interrupt among them is still raised). Two children whose
    bits collide are visited together: a visit that finds nothing costs one
    collective of that child, never a wrong result."""
    try:
        for child in list(fam.children):
            if child.bit & bits:
                sink.extend((seq, f) for f in child.visit(deadline))
    finally:
        # This frame is the f_back of the children's visits, which the
        # failures' tracebacks hold: it must not hold the failures' list.
        del sink
    if any(c.done() for c in fam.children):
        fam.children = [c for c in fam.children if not c.done()]
        _publish(fam)


# Families that no parent reaches, in the order this rank listed them (see
# _Listed): a sync point of a family whose group contains one adopts it once
# its agreement says every rank of it has listed it (see reach and adopt);
# until then unreached_families() names them.
_UNREACHED: list[_Listed] = []

# The agreed flags' bits that say "some rank has listed a family it may not
# yet adopt" (collective_gc._agree.FLAG_UNRIPE): buckets, by the bit the
# family would have among the parent's children.
_BUCKETS = tuple(1 << i for i in range(8) if FLAG_UNRIPE >> i & 1)


class _Listed:
    """A family on the unreached list, on this rank.

    Listing is local, and on another thread than the one running the sync
    points that could adopt it (a library's communicator freed, or a
    manager closed, on a second thread) it happens between different sync
    points of the parent on each rank. Adopting it then at the first sync
    point that looks would make it a child on some ranks and not on others:
    the ones that adopted wait in its sync point for the others, for ever.
    So a listing is announced: every rank that lists the family posts a
    non-blocking barrier (``req``) over the family's own private duplicate,
    right after its first collective (made with nothing around it), or when
    the family that reached it let go, after the last of its sync points
    that family's visits ran. The barrier completes only once every rank
    has listed it. (Not the private duplicate of the family that let go: a
    rank still in one of its sync points too many, a program error, would
    have its allreduce matched with the others' barrier instead of timing
    out. A sync point of the orphan itself, run on another thread while
    its parent lets go, would be matched so too: not promised.)

    A rank that finds the barrier complete (it looks at each sync point
    that looks through the list, and when a family is made) knows every
    rank of it had listed it by then. A collective this rank begins after
    that (a parent's agreement, or the duplicate that made the parent)
    completes on no rank before this rank began it, so at the parent's next
    sync point every rank of the family has it listed. Then: a rank whose
    entry is ripe (found complete before it began the parent's last
    collective, its ``reach_mark``) offers it; one whose entry is not sets
    its bucket's bit in the agreed flags. Where the agreed flags carry no
    bit of its bucket, every rank of it had it ripe, and all adopt it in
    that sync point, after the agreement: alike on every rank of it. A
    bucket is held only by entries still ripening, which every rank lists
    eventually, so a collision delays, never stops, an adoption; a family
    listed long before a parent is made is adopted at its first sync point.

    Not announced (a family of one process, whose sync points involve no
    other rank; the orphans of an unusable family, whose communicator can
    carry nothing more; where MPI may not be called), a family is adopted
    by the first sync point that looks, as it always was."""

    __slots__ = ("fam", "owner", "req", "announced", "done_at")

    def __init__(self, fam: Collective, owner: Manager, announced: bool) -> None:
        self.fam = weakref.ref(fam)
        self.owner = weakref.ref(owner)
        # Posted only once the entry is listed (see add_unreached); until
        # then, an announced entry is unripe.
        self.req: MPI.Request | None = None
        self.announced = announced
        self.done_at = 0  # when this rank found the barrier complete (0: not yet)

    def look(self) -> None:
        """Whether the barrier completed, noted with the time (monotonic,
        this rank's: only compared with this rank's own marks). Local."""
        if not self.done_at and self.req is not None and test_kept(self.req):
            self.req = None
            self.done_at = time.monotonic_ns()


def _look() -> int:
    # Every listed barrier looked at, then the time: a collective begun after
    # it follows whatever it found complete.
    for entry in _UNREACHED:
        if entry.announced:
            entry.look()
    return time.monotonic_ns()


def opening(fam: Collective) -> None:
    """``fam``'s first collective (the duplicate that makes it) begins on
    this rank: what is found listed everywhere before it, its first sync
    point may adopt. Local, but for MPI_Test."""
    fam.reach_mark = _look() if _UNREACHED else time.monotonic_ns()


def add_unreached(
    fam: Collective,
    mgr: Manager,
    families: Iterable[Collective],
    announce: MPI.Intracomm | None = None,
) -> None:
    """``fam`` (first used through ``mgr``) was reached by nothing: every
    family's sync point looks through the list (they may contain it).
    ``announce``: the communicator of the barrier (see :class:`_Listed`);
    None for a family of one process. Local, but for that barrier's post.

    The entry is listed before its barrier is posted: a barrier complete
    on some rank says that every rank has listed the family only if no
    rank posts it before listing (a sync point of another thread's, run
    while this one posts, would find it unlisted here and listed there)."""
    announced = fam.size > 1 and announce is not None and mpi_usable()
    entry = _Listed(fam, mgr, announced)
    try:
        _UNREACHED.append(entry)
        if announce is not None and announced:
            entry.req = ibarrier(announce)  # every rank has listed (see _Listed)
    except BaseException:
        _drop([entry])  # never ripe without its barrier: not listed at all
        raise
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
    children, which its sync points reached, are unreached again, for a
    sync point of a family that contains them to adopt (a library's Split
    made under a scope on a duplicate the library then frees is reached by
    the sync points of the communicator it duplicated). Each is announced
    by a barrier over its own private duplicate (see :class:`_Listed`):
    ``fam``'s, which a rank still in one of its sync points too many may
    use yet, must carry nothing more. Local but for that barrier's post."""
    children, fam.children = fam.children, []
    _publish(fam)
    for child in children:
        if child.done() or child.fam.parent is not fam:
            continue
        child.fam.parent = None
        owner = child.owner()
        if owner is None:
            continue
        sub = child.fam
        add_unreached(sub, owner, families, sub.core.comm if sub.core.reason is None else None)


def forget_unreached(fam: Collective) -> None:
    """``fam`` was reached (adopted as a child): off the list. Local."""
    _drop([e for e in _UNREACHED if e.fam() is None or e.fam() is fam])


def _drop(entries: list[_Listed]) -> None:
    # One removal at a time: another thread may list a family meanwhile (a
    # free or a close there), which a rewrite of the whole list would lose.
    for entry in entries:
        try:
            _UNREACHED.remove(entry)
        except ValueError:
            pass  # removed already, by a look on another thread: nothing is lost


class Offer:
    """What a parent's sync point may adopt (see :class:`_Listed`): made by
    :func:`reach` in its prepare, taken by :func:`adopt` after its
    agreement."""

    __slots__ = ("unripe", "wanted", "ripe")

    def __init__(self) -> None:
        self.unripe = 0  # the flags' bits of the entries not yet ripe here
        self.wanted = 0  # the children bits of ripe entries that want a visit
        self.ripe: list[tuple[Collective, MPI.Intracomm, int]] = []


NO_OFFER = Offer()


def reach(parent: Collective) -> Offer:
    """At a sync point of ``parent`` (its prepare): the unreached
    families its group contains. Those without a barrier are adopted now;
    the others are offered (see :class:`_Listed`). What is left belongs to
    other families' groups: ``parent`` needs not look again until the list
    grows (its HOLD_REACH bit), unless it offered something."""
    parent.core.set_hold(HOLD_REACH, False)
    pcomm = parent.core.comm
    before = parent.reach_mark
    if not _UNREACHED or pcomm is None:
        parent.reach_mark = time.monotonic_ns()
        return NO_OFFER
    parent.reach_mark = _look()  # this sync point's agreement begins after it
    offer: Offer | None = None
    gone = []
    for entry in list(_UNREACHED):
        fam, owner = entry.fam(), entry.owner()
        if fam is None or owner is None or not fam.members or fam.core.reason is not None:
            gone.append(entry)
            continue
        if fam.parent is not None:
            gone.append(entry)  # reached meanwhile
            continue
        if fam is parent or reaches(fam, parent):
            continue  # it reaches the parent: never its child
        try:
            comm = owner.comm
        except CollectiveGCError:
            gone.append(entry)
            continue
        ranks = ranks_in(pcomm, comm)
        if ranks is None:
            continue  # not inside
        label = f"a communicator of size {fam.size} reached from a {parent.label}"
        if not entry.announced:
            if link(parent, fam, comm, label):
                gone.append(entry)
            continue
        gave_up = _gave_up(fam)
        if gave_up:
            gone.append(entry)  # never ripe on every rank, or ripe by mistake
            continue
        if offer is None:
            offer = Offer()
        bit = child_bit(hash(ranks) & ((1 << 64) - 1))
        if 0 < entry.done_at < before and gave_up is not None:
            offer.ripe.append((fam, comm, bit))
            if fam.core.wants():
                offer.wanted |= bit
        else:
            offer.unripe |= _bucket(bit)
    _drop(gone)
    if offer is None:
        return NO_OFFER
    parent.core.set_hold(HOLD_REACH, True)  # it looks again at its next sync point
    return offer


def _gave_up(fam: Collective) -> bool | None:
    """Whether a rank of ``fam`` gave up on it (its watch took the notice).
    Then a listing of ``fam`` can never be ripe on every rank alike: a rank
    that gave up lists it as unusable (adopted by nothing, never announced),
    so its barrier either never completes or completes only by matching
    what that rank left posted on the same communicator (the agreement it
    gave up on). Either way it is not adopted, here as there; its own next
    sync point raises the notice's error. The watch has one tester at a
    time, the family lock's holder: None while another thread holds it (not
    known: the listing is not offered at this sync point, as if unripe).
    A rank the notice has not reached yet may still adopt it alone: then
    the family's first visit from its new parent raises the notice's
    error there, as the family's own sync point would have. Local."""
    if not fam.lock.acquire(blocking=False):
        return None
    try:
        return bool(fam.core.fired())
    finally:
        fam.lock.release()


def _bucket(bit: int) -> int:
    return _BUCKETS[bit.bit_length() % len(_BUCKETS)]


def adopt(parent: Collective, offer: Offer, agreed_flags: int) -> None:
    """After the agreement of the sync point whose prepare made ``offer``:
    the ripe entries whose bucket no rank holds become ``parent``'s
    children, on every rank of each at once (see :class:`_Listed`)."""
    for fam, comm, bit in offer.ripe:
        if agreed_flags & _bucket(bit) or fam.parent is not None:
            continue
        label = f"a communicator of size {fam.size} reached from a {parent.label}"
        if link(parent, fam, comm, label):
            forget_unreached(fam)


def unreached_families() -> list[tuple[Collective, Manager]]:
    """(family, the manager first used) of the unreached families still
    alive and not yet reached. Local."""
    out = []
    for entry in _UNREACHED:
        fam, mgr = entry.fam(), entry.owner()
        if fam is not None and mgr is not None and fam.parent is None:
            out.append((fam, mgr))
    return out


def after_fork() -> None:
    """In a forked child nothing is reached from here."""
    _UNREACHED.clear()
