"""The leases of a loader's slots: which elements still view which segment.

Every array of an element views one ``base`` array over its slot. A
:class:`Lease`, a weak reference to ``base`` kept alive by a module-level
set (as ``weakref.finalize`` keeps its finalizers, so a lease is never part
of a user's garbage cycle), pins the slot's :class:`Segment`. Its callback,
on whatever thread ``base`` dies and inside the cyclic collector too, is a
C-level list append (no Python code runs, so no interrupt can strike there);
the consumer looks at the dead leases when it next talks to a worker
(:func:`collect_dead`) and sends their slots back, and the worker may only
then write into them. A lease of an element that was built but never
delivered (an interrupt struck first) frees nothing: the element is rebuilt
from the same slot by the next call. When a loader closes, its leases are let
go (:func:`let_go`): an element that outlives the loader releases its memory
with its last array.

Segment release is bounded: when the rank-local reaper falls behind (a slow
or blocked destroy ahead of ours), the consumer unmaps dead segments itself
once more than ``BACKLOG`` wait (:func:`release_backlog`).

Part of a worker's handle (``_pool.WorkerHandle``): :class:`SlotTable`, its
slots and the leases on them. Nothing here refers to a loader, an element or
an exception.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Protocol

import numpy as np

from .. import Registration
from ._shm import Segment

__all__ = [
    "BACKLOG",
    "DEAD",
    "LEASES",
    "Lease",
    "Owner",
    "SlotTable",
    "collect_dead",
    "forget_in_child",
    "let_go",
    "release_backlog",
    "watch_segment",
]

# Dead segments allowed to wait for the reaper before the consumer unmaps them itself.
BACKLOG = 32


class Owner(Protocol):
    """What a lease needs of the handle whose slot it pins."""

    closed: bool
    freed: list[tuple[int, int]]
    live: set[int]


class Lease(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to an element's ``base`` that pins its slot's segment."""

    __slots__ = ("delivered", "handle", "segment", "seq", "slot")
    handle: Owner
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
# Leases whose element died, not yet looked at. The callback of every lease is
# this list's C-level append: no Python frame runs when an element dies, so
# no interrupt (KeyboardInterrupt) can strike, and be swallowed, there.
DEAD: list[Lease] = []


def collect_dead() -> None:
    """Hand the slots of dead elements back to their handles (consumer thread)."""
    dead, leases = DEAD, LEASES
    while dead:
        # Taken with bytecodes that call nothing, then recorded before it is let go.
        lease = dead[-1]
        del dead[-1]
        if lease.delivered:
            handle = lease.handle
            # The slot first: an interrupt after that call (the only place one
            # can strike here) must not lose it, or the worker's ring shrinks
            # for good and it may end up waiting for ever.
            if not handle.closed:
                handle.freed.append((lease.slot, lease.seq))
            handle.live.discard(lease.slot)
        # Unpins the segment; if that was its last holder, the segment's own
        # finalizer queues the unmap on the reaper.
        leases.discard(lease)


def let_go(handle: Owner) -> None:
    """Forget the leases on ``handle``'s slots (its worker is stopped).

    Nobody will hand those slots back any more: a segment viewed by an
    element that outlives the loader is then unmapped with that element's
    last array (mmap's own release), not pinned.
    """
    for lease in [x for x in list(LEASES) if x.handle is handle]:
        LEASES.discard(lease)


class SlotTable:
    """A handle's slots (mapped segments, by slot number) and the leases on them."""

    slots: dict[int, Segment]
    live: set[int]  # slots an element not yet dead views
    freed: list[tuple[int, int]]  # (slot, element) of dead elements, owed to the worker
    attached: int
    closed: bool

    def init_slots(self) -> None:
        self.attached = -1  # the element whose new segment was mapped last
        # `freed` and `live` are also touched by lease callbacks, on any
        # thread: appends and discards only.
        self.freed = []
        self.live = set()
        self.slots = {}

    def lease(self, slot: int, seq: int, base: np.ndarray[Any, Any]) -> Lease:
        """Pin ``slot`` until ``base`` (which every array of the element views) dies."""
        lease = Lease(base, DEAD.append)
        lease.handle, lease.slot, lease.seq, lease.segment = self, slot, seq, self.slots[slot]
        lease.delivered = False
        self.live.add(slot)
        LEASES.add(lease)
        return lease


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
