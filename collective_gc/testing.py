"""What a test can ask of collective_gc's core: which way each sync point
went, and what a family holds on this rank. Reads only, local (no MPI), for
test suites: ours, and a library's that wants to check it takes the steady
state. (``collective_gc.data.testing`` is the loader's.)

- :func:`outcomes`: a context manager collecting, for each sync point that
  tried the steady state (``cgc.collect``, a scope's ``sync``, a
  ``@sync_point``, with a timeout or without), which way it went: ``"steady"`` (every step
  took its fast case: one collective, no Python steps where the extension
  runs it), ``"failed"`` (the same, but destroys or finishes raised: kept for
  the family's next agreement), ``"resume"`` (nothing was unusual here, but
  the agreement found something elsewhere: the steps went on from it),
  ``"watch"`` (a rank gave up while this one waited), ``"steps"``
  (something unusual here: the steps ran it all). The same in both legs:
  with the C extension and with the Python twins.
- :func:`family`: a :class:`Family` snapshot of the family a communicator
  belongs to.
- :func:`retired`: how many private duplicates of families this rank let
  go of it keeps (messages may still arrive on them), and the most it keeps.
- :func:`speedups`: ``"c+mpi"`` or ``"python"`` (collective_gc._switch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

from mpi4py import MPI

from . import _tracing, _transport, _tree
from ._lookup import lookup
from ._manager import family as _family_of
from ._state import HOLD_GONE, HOLD_LEAVING, HOLD_PARTS, HOLD_REACH
from ._switch import speedups

__all__ = ["Family", "outcomes", "family", "retired", "speedups"]


class Family(NamedTuple):
    """A family's state on this rank, read without changing anything.

    Attributes:
        label: what messages call it.
        size: its processes.
        seq: sync points completed.
        next_key: the key the next registration gets.
        live: registrations whose destroy has not run.
        pending: keys queued here and not yet destroyed (drained ones).
        inbox: registrations queued since the last sync point (not drained).
        window: (first key, bits) of the agreement's key window.
        words: the length, in int64 words, of the last agreement's message.
        persistent: whether its agreement is MPI-4's persistent allreduce.
        holds: why its sync points may not take the steady state now
            ("leaving", "participants", "reach", "gone"; empty: none).
        children: labels of the child families its sync points reach.
        members: its communicators' managers still alive.
        unreported: failures kept for its next agreement.
        broken: why it is unusable, or None.
    """

    label: str
    size: int
    seq: int
    next_key: int
    live: int
    pending: list[int]
    inbox: int
    window: tuple[int, int]
    words: int
    persistent: bool
    holds: tuple[str, ...]
    children: list[str]
    members: int
    unreported: int
    broken: str | None


_HOLDS = (
    (HOLD_LEAVING, "leaving"),
    (HOLD_PARTS, "participants"),
    (HOLD_REACH, "reach"),
    (HOLD_GONE, "gone"),
)


@contextmanager
def outcomes() -> Iterator[list[str]]:
    """Collect which way each sync point went (see the module docs), in
    order, on this rank, while the block runs. Not nested: the last one set wins."""
    seen: list[str] = []

    def note(label: str, way: str) -> None:
        seen.append(way)

    before = _tracing.set_observer(note)
    try:
        yield seen
    finally:
        _tracing.set_observer(before)


def family(comm: MPI.Comm) -> Family | None:
    """The family ``comm``'s manager belongs to, or None before its first
    collective (or if it has no manager). Local."""
    mgr = lookup(comm)
    fam = None if mgr is None else _family_of(mgr)
    if fam is None:
        return None
    core = fam.core
    raw, _ = core.pending_keys()
    return Family(
        fam.label,
        fam.size,
        core.seq,
        core.next_key,
        len(core.live),
        memoryview(raw).cast("q").tolist() if raw else [],
        len(core.inbox),
        core.window,
        core.words,
        bool(core.persistent),
        tuple(name for bit, name in _HOLDS if core.hold & bit),
        [c.label for c in _tree.children_of(fam)],
        len(fam.live_members()),
        len(core.unreported),
        core.reason,
    )


def retired() -> tuple[int, int]:
    """(kept, most): the private duplicates of families this rank let go of
    that it keeps, not yet freed, and the most it keeps. Local."""
    return _transport.kept(), _transport.RETIRED
