"""Python's cyclic collector under collective scopes: when it runs, and what to collect.

:class:`GcPolicy` decides, for every open scope of every thread, whether the
automatic collector is on. :func:`wanted_generation` says which generation
the automatic collector would collect now (a managed scope's vote at each
sync point; the ranks then collect the oldest any of them wants), and
:func:`collect` collects it, keeping the books CPython keeps for its
long-lived objects.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["GcPolicy", "POLICY", "wanted_generation", "collect"]


class GcPolicy:
    """Whether Python's automatic collector runs, for every open scope of every thread.

    The collector is process-wide, so scopes on several threads must not each
    save and restore it: the last one out would restore what the first one
    found (or what another thread's scope had set). Instead, while any
    ``gc="managed"``/``"off"`` scope is open, anywhere, it is off; else while
    any ``gc="auto"`` scope is open it is on; and when the last scope closes,
    it is put back as it was when the first one opened.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.off = 0
        self.auto = 0
        self.saved = True

    def enter(self, mode: str) -> None:
        with self.lock:
            if not (self.off or self.auto):
                self.saved = gc.isenabled()
            if mode == "auto":
                self.auto += 1
            else:
                self.off += 1
            self._apply()

    def leave(self, mode: str) -> None:
        with self.lock:
            if mode == "auto":
                self.auto = max(0, self.auto - 1)
            else:
                self.off = max(0, self.off - 1)
            self._apply()

    def _apply(self) -> None:
        if self.off:
            gc.disable()
        elif self.auto or self.saved:
            gc.enable()
        else:
            gc.disable()


POLICY = GcPolicy()


# CPython runs a full collection only when the objects promoted to the oldest
# generation since the last full one exceed a quarter of those that survived
# it (gcmodule.c, "long_lived_pending > long_lived_total / 4"), so that a
# large long-lived heap is not traversed over and over. Managed mode keeps the
# same rule, with its own books: the objects in the oldest generation after
# the last full collection (None: not measured yet), and those promoted since.
_LONG_LIVED_TOTAL: list[int | None] = [None]
_LONG_LIVED_PENDING: list[int] = [0]


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
        total = _LONG_LIVED_TOTAL[0]
        if total is None:
            total = _LONG_LIVED_TOTAL[0] = len(gc.get_objects(2))
        if _LONG_LIVED_PENDING[0] > total // 4:
            return 2
    if c1 > t1:
        return 1
    return 0


def collect(generation: int) -> int:
    """``gc.collect(generation)``, keeping the books of the long-lived rule."""
    if generation >= 2:
        found = gc.collect(2)
        _LONG_LIVED_TOTAL[0] = len(gc.get_objects(2))
        _LONG_LIVED_PENDING[0] = 0
        return found
    if generation == 1:
        # What survives a collection of generation 1 is promoted to 2.
        before = len(gc.get_objects(0)) + len(gc.get_objects(1))
        found = gc.collect(1)
        _LONG_LIVED_PENDING[0] += max(0, before - found)
        return found
    return gc.collect(0)
