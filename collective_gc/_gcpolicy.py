"""Python's cyclic collector under collective scopes: when it runs, and what to collect.

:class:`GcPolicy` decides, for every open scope of every thread, whether the
automatic collector is on, and holds the long-lived heap it froze.
:func:`wanted_generation` says which generation the automatic collector would
collect now (a managed scope's vote at each sync point; the ranks then
collect the oldest any of them wants), and :func:`collect` collects it,
keeping the books CPython keeps for its long-lived objects.

Freezing. A full collection walks every tracked object, so over a large
long-lived heap (a mesh, caches, millions of objects) each one costs a walk
of the heap although almost none of it is garbage. After an *agreed* full
collection inside a managed scope (``collect(2, agreed=True)``) has left at
least :attr:`GcPolicy.freeze_min` objects in the oldest generation, and at
least as many as are frozen already, the policy moves them all to the
permanent generation (``gc.freeze()``): later full collections walk only
what was promoted since. Nothing frozen is garbage at that moment (the full
collection just ran), but frozen objects are never collected, so:

- a collection that is not agreed (a scope's exit collection) thaws the
  frozen heap first (``gc.unfreeze()``) and collects everything: what died
  after the freeze is found there, as it would have been without one;
- when the last managed scope closes, the frozen heap is thawed, so that the
  collector behaves afterwards as it did before the scope, exceptions
  included;
- objects that become cyclic garbage while frozen are found only then (or
  at the next freeze-free full collection), not at the agreed collections
  in between.

If the permanent generation held objects when the policy would first freeze
(someone called ``gc.freeze()``, a pre-fork server for instance), or more
than it froze later, the policy leaves it alone: it neither freezes nor
thaws what is not its own while the program runs. At exit it does
(:func:`thaw_all`): a freeze also takes whatever was cyclic garbage at that
moment out of the collector's reach (a managed object that died in a cycle
while the collector was off, by the program's ``gc.disable()`` or inside a
scope), and its destroy would never run, silently. So the exit thaws the
permanent generation before its full collection, and the exit agreement
destroys what that collection finds. Nothing runs in the process after that
which a freeze could still serve (a forked child runs none of the parent's
exit), and the collection walks the heap once more than it would have.

CPython 3.12's collector itself moves the immortal objects it meets into the
permanent generation (3.11 has none there; 3.13 untracks them instead), so on
3.12 the permanent generation is never empty although nobody froze anything.
What it held when this module was imported, and what a full collection of
the policy's adds to it, is counted as the collector's
(:attr:`GcPolicy.collector_frozen`), not as someone's freeze. A freeze made
on 3.12 before ``collective_gc`` is imported is therefore not told apart
from the interpreter's own.
"""

from __future__ import annotations

import gc
import sys
import threading

__all__ = ["GcPolicy", "POLICY", "wanted_generation", "collect", "thaw_all"]


class GcPolicy:
    """Whether Python's automatic collector runs, for every open scope of every thread.

    The collector is process-wide, so scopes on several threads must not each
    save and restore it: the last one out would restore what the first one
    found (or what another thread's scope had set). Instead, while any
    ``gc="managed"``/``"off"`` scope is open, anywhere, it is off; else while
    any ``gc="auto"`` scope is open it is on; and when the last scope closes,
    it is put back as it was when the first one opened. Likewise the heap
    frozen by agreed full collections (see the module docs) stays frozen
    while any managed scope is open, and is thawed when the last one closes.
    """

    # Below this many survivors a full collection is cheap enough that
    # freezing them would only delay the collection of the ones that die.
    freeze_min = 100_000

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.off = 0
        self.auto = 0
        self.managed = 0
        self.saved = True
        # gc.get_freeze_count() right after this policy's last freeze; 0: it
        # froze nothing. Frozen objects freed by refcounting make the
        # count drop, never rise: a rise means someone else froze too.
        self.frozen = 0
        # How many objects in the permanent generation the collector put
        # there itself (CPython 3.12's immortal objects; see the module docs).
        self.collector_frozen = gc.get_freeze_count() if sys.version_info[:2] == (3, 12) else 0
        # The books of CPython's long-lived rule (see collect): the objects in
        # the oldest generation after the last full collection (None: not
        # measured yet: wanted_generation measures it), and those promoted
        # since. This module's functions are their only writers.
        self.long_lived_total: int | None = None
        self.long_lived_pending = 0

    def enter(self, mode: str) -> None:
        with self.lock:
            if not (self.off or self.auto):
                self.saved = gc.isenabled()
            if mode == "auto":
                self.auto += 1
            else:
                self.off += 1
                if mode == "managed":
                    self.managed += 1
            self._apply()

    def leave(self, mode: str) -> None:
        with self.lock:
            if mode == "auto":
                self.auto = max(0, self.auto - 1)
            else:
                self.off = max(0, self.off - 1)
                if mode == "managed":
                    self.managed = max(0, self.managed - 1)
                    if not self.managed:
                        self._thaw()
            self._apply()

    def _apply(self) -> None:
        if self.off:
            gc.disable()
        elif self.auto or self.saved:
            gc.enable()
        else:
            gc.disable()

    def _thaw(self) -> None:
        """Give back what this policy froze (with the lock held)."""
        if self.frozen and 0 < gc.get_freeze_count() <= self.frozen:
            gc.unfreeze()
            # The thawed heap is in the oldest generation again.
            self.long_lived_total = None
        self.frozen = 0

    def thaw(self) -> None:
        """Thaw what this policy froze, so that a collection sees everything."""
        with self.lock:
            self._thaw()

    def maybe_freeze(self, survivors: int) -> bool:
        """After an agreed full collection left ``survivors`` in the oldest generation:
        freeze them if there are enough, inside a managed scope. True if frozen."""
        with self.lock:
            if not self.managed:
                return False
            count = gc.get_freeze_count()
            if count > max(self.frozen, self.collector_frozen):
                return False  # not ours
            if survivors < max(self.freeze_min, count):
                return False
            gc.freeze()
            self.frozen = gc.get_freeze_count()
            return True


POLICY = GcPolicy()


def thaw_all() -> None:
    """At exit, before the exit collection: thaw the permanent generation,
    whoever froze it (see the module docs)."""
    # A daemon thread may still run at exit; it holds the lock only for a few
    # steps, and a thread stopped with it held must not stop the exit.
    got = POLICY.lock.acquire(timeout=1.0)
    try:
        if gc.get_freeze_count():
            gc.unfreeze()
            POLICY.long_lived_total = None
        POLICY.frozen = 0
    finally:
        if got:
            POLICY.lock.release()


def after_fork() -> None:
    """In a forked child: a fresh lock (one that another thread held at the
    fork is never released there)."""
    POLICY.lock = threading.Lock()


# CPython runs a full collection only when the objects promoted to the oldest
# generation since the last full one exceed a quarter of those that survived
# it (gcmodule.c, "long_lived_pending > long_lived_total / 4"), so that a
# large long-lived heap is not traversed over and over. Managed mode keeps the
# same rule, with its own books (POLICY's long_lived_total and _pending).
# Frozen objects are in no generation, so after a freeze the books count only
# what a full collection still walks.


def wanted_generation() -> int:
    """The generation Python's automatic collector would collect now, or -1.

    CPython collects when the youngest generation's count passes its threshold,
    and then the oldest generation whose count passes its own threshold (for
    the oldest, only if enough objects were promoted since the last full one).
    """
    t0, t1, t2 = gc.get_threshold()
    c0, c1, c2 = gc.get_count()
    if t0 == 0 or c0 <= t0:
        return -1
    if c2 > t2 and c1 > t1:
        total = POLICY.long_lived_total
        if total is None:
            total = POLICY.long_lived_total = len(gc.get_objects(2))
        if POLICY.long_lived_pending > total // 4:
            return 2
    if c1 > t1:
        return 1
    return 0


def collect(generation: int, *, agreed: bool = False) -> int:
    """``gc.collect(generation)``, keeping the books of the long-lived rule.

    ``agreed=True``: a collection the ranks agreed on at a sync point of a
    managed scope; a full one leaves the heap the policy froze frozen, and
    may freeze what survives it. ``agreed=False`` (a scope's exit collection,
    any collection that must find everything): a full one thaws the frozen
    heap first.
    """
    if generation >= 2:
        if not agreed:
            POLICY.thaw()
        before = gc.get_freeze_count()
        found = gc.collect(2)
        # A collection freezes nothing, but on 3.12 it moves immortal objects there.
        moved = gc.get_freeze_count() - before
        if moved > POLICY.collector_frozen:
            POLICY.collector_frozen = moved
        survivors = len(gc.get_objects(2))
        if agreed and POLICY.maybe_freeze(survivors):
            survivors = 0
        POLICY.long_lived_total = survivors
        POLICY.long_lived_pending = 0
        return found
    if generation == 1:
        # What survives a collection of generation 1 is promoted to 2.
        before = len(gc.get_objects(0)) + len(gc.get_objects(1))
        found = gc.collect(1)
        POLICY.long_lived_pending += max(0, before - found)
        return found
    return gc.collect(0)
