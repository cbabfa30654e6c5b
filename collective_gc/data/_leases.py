"""A worker's slots, and the leases elements hold on them.

Every array of an element views one ``base`` array over its slot. A
:class:`Lease`, a weak reference to ``base`` kept alive by a module-level
set (as ``weakref.finalize`` keeps its finalizers, so a lease is never part
of a user's garbage cycle), pins the slot's :class:`Segment`. Its callback,
on whatever thread ``base`` dies, is a C-level list append (NOTE [ Loader
shutdown and interrupts ] in ``_loader``, rule 5); the consumer looks at the
dead leases when it next talks to a worker (:func:`collect_dead`) and sends
their slots back, and the worker may only then write into them. A lease of
an element that was built but never delivered (an interrupt struck first)
frees nothing: the element is rebuilt from the same slot by the next call.
When a worker stops, the leases on its slots are let go (:meth:`SlotTable.close`):
an element that outlives the loader releases its memory with its last array.

Segment release is bounded: when the rank-local reaper falls behind (a slow
or blocked destroy ahead of ours), the consumer unmaps dead segments itself
once more than ``BACKLOG`` wait (:func:`release_backlog`).

:class:`SlotTable` is the slots part of a worker's handle (``_pool``); its
channel (``_channel``) maps segments into it and sends back what it frees.
Nothing here refers to a loader, an element or an exception.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import numpy as np

from .. import Registration
from ._shm import Segment

__all__ = [
    "BACKLOG",
    "DEAD",
    "LEASES",
    "Lease",
    "SlotTable",
    "collect_dead",
    "forget_in_child",
    "release_backlog",
    "watch_segment",
]

# Dead segments allowed to wait for the reaper before the consumer unmaps them itself.
BACKLOG = 32


class Lease(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to an element's ``base`` that pins its slot's segment."""

    __slots__ = ("delivered", "segment", "seq", "slot", "table")
    table: SlotTable
    slot: int
    seq: int
    segment: Segment
    delivered: bool

    # By identity: weakref.ref's own would hash and compare the (unhashable) array.
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__


# The leases of live elements. Module-level, so a lease is reachable from here
# and never trash itself: its callback runs even when the element dies in a
# garbage cycle together with its loader.
LEASES: set[Lease] = set()
# Leases whose element died, not yet looked at: the callback of every lease
# is this list's C-level append (NOTE [ Loader shutdown and interrupts ] in
# _loader, rule 5).
DEAD: list[Lease] = []


def collect_dead() -> None:
    """Hand the slots of dead elements back to their tables (consumer thread)."""
    dead, leases = DEAD, LEASES
    while dead:
        # Taken with bytecodes that call nothing, then recorded before it is let go.
        lease = dead[-1]
        del dead[-1]
        if lease.delivered:
            table = lease.table
            # The slot first: an interrupt after that call (the only place one
            # can strike here) must not lose it, or the worker's ring shrinks
            # for good and it may end up waiting for ever.
            if not table.closed:
                table.freed.append((lease.slot, lease.seq))
            table.live.discard(lease.slot)
        # Unpins the segment; if that was its last holder, the segment's own
        # finalizer queues the unmap on the reaper.
        leases.discard(lease)


class SlotTable:
    """A worker's slots (mapped segments, by slot number) and the leases on them."""

    __slots__ = ("closed", "freed", "live", "segments")

    def __init__(self) -> None:
        self.segments: dict[int, Segment] = {}
        # `freed` and `live` are also touched by collect_dead, on whatever
        # thread talks to a worker or stops a pool: appends and discards only.
        self.live: set[int] = set()  # slots an element not yet dead views
        self.freed: list[tuple[int, int]] = []  # (slot, element) of dead elements, owed
        self.closed = False  # the worker is stopped: nothing is owed to it any more

    def lease(self, slot: int, seq: int, base: np.ndarray[Any, Any]) -> Lease:
        """Pin ``slot`` until ``base`` (which every array of the element views) dies."""
        lease = Lease(base, DEAD.append)
        lease.table, lease.slot, lease.seq, lease.segment = self, slot, seq, self.segments[slot]
        lease.delivered = False
        self.live.add(slot)
        LEASES.add(lease)
        return lease

    def close(self) -> None:
        """The worker is stopped: forget the slots and let their leases go. Idempotent.

        Segments no lease holds are unmapped now (on the reaper); a segment
        viewed by an element that outlives the loader is unmapped with that
        element's last array (mmap's own release), not pinned: nobody will
        hand its slot back any more.
        """
        self.closed = True
        self.segments.clear()
        for lease in [x for x in list(LEASES) if x.table is self]:
            LEASES.discard(lease)

    def forget_in_child(self) -> None:
        """In a forked child: unmap this process's copies of the slots nothing here views."""
        self.closed = True
        for segment in self.segments.values():
            segment.unmap_if_unused()
        self.segments.clear()


# -- bounded segment release ------------------------------------------------------------

# Registrations of dead segments whose unmap may still wait on the reaper, oldest first.
DUE: collections.deque[Registration] = collections.deque()


class SegmentWatch(weakref.ref):  # type: ignore[type-arg]
    __slots__ = ("reg",)
    reg: Registration


# Watches of live segments, and of segments that died (their callback is this
# list's C-level append, for the same reason as the leases').
WATCHES: set[SegmentWatch] = set()
DIED: list[SegmentWatch] = []


def watch_segment(segment: Segment) -> None:
    watch = SegmentWatch(segment, DIED.append)
    watch.reg = segment.reg
    WATCHES.add(watch)


def release_backlog(limit: int = BACKLOG) -> None:
    """Unmap dead segments on this thread while more than ``limit`` wait for the reaper.

    The reaper runs every rank-local destroy of the process, in order: one slow
    or blocked destroy ahead of ours would let unmapped memory pile up. The
    registration runs each unmap exactly once, whoever gets there first.
    """
    due, died = DUE, DIED
    while died:
        watch = died[-1]
        del died[-1]
        due.append(watch.reg)
        WATCHES.discard(watch)
    while due and not due[0].alive:
        due.popleft()
    while len(due) > limit:
        due.popleft().destroy()


def forget_in_child() -> None:
    """In a forked child: the parent's leases and watches (nobody here hands their slots back)."""
    LEASES.clear()
    DEAD.clear()
    DUE.clear()
    DIED.clear()
    WATCHES.clear()
