"""Where a sync point's phases go when someone watches: the tracer hook.

Off by default: then a sync point reads one list item and does nothing
more, and the steady state runs in C (``FamilyState.steady``). With a tracer
set (:mod:`collective_gc.trace`, from ``COLLECTIVE_GC_TRACE=path`` or its
API), every sync point, the steady ones included (they then run in their
Python twin, which marks its phases), hands the tracer what it did, on
this rank, in this rank's own clock (``time.perf_counter``: nodes do not
share one):

- ``wait``: blocked in the agreement's allreduce, waiting for the other
  ranks (most of it is the slowest rank's lateness);
- ``agree``: the rest of the agreement (packing, reading, the fallback);
- ``destroy``, ``visit`` (derived families), ``check``, ``finish``
  (participants: PETSc's cleanup, the scope's collection), ``report``.

A tracer must only record: it runs inside the sync point, on its thread,
and must not call MPI or collective_gc.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

__all__ = ["Tracer", "TRACER", "OBSERVER", "set_tracer", "set_observer", "Phases"]

# (phase, start, end) in time.perf_counter seconds.
Phases = list[tuple[str, float, float]]


class Tracer(Protocol):
    """What receives each sync point's phases (see the module docs)."""

    def sync_point_began(self, family: str, rank: int, seq: int, start: float) -> None:
        """Sync point ``seq`` of ``family`` began on this rank at ``start``
        (before its agreement: a run that hangs there, or is killed, has
        this and no :meth:`sync_point` for it)."""
        ...

    def sync_point(
        self,
        family: str,
        rank: int,
        seq: int,
        start: float,
        end: float,
        phases: Phases,
        destroyed: int,
        outcome: str,
    ) -> None:
        """One sync point of ``family`` (its label) on this rank: number
        ``seq``, from ``start`` to ``end``, its ``phases``, how many destroys
        ran, and how it ended (``"ok"``, or the name of what it raised)."""
        ...


# The tracer, or None; and what is told which way each sync point that tried
# the steady state went (collective_gc.testing). Module attributes the hot
# path reads; only the setters below write them.
TRACER: Tracer | None = None
OBSERVER: Callable[[str, str], None] | None = None


def set_tracer(tracer: Tracer | None) -> Tracer | None:
    """Set the tracer (None: off); returns the one before. Local."""
    global TRACER
    before, TRACER = TRACER, tracer
    return before


def set_observer(observer: Callable[[str, str], None] | None) -> Callable[[str, str], None] | None:
    """Set what is told ``(family label, way)`` after each sync point that
    tried the steady state (None: nothing); returns the one before. Local."""
    global OBSERVER
    before, OBSERVER = OBSERVER, observer
    return before
