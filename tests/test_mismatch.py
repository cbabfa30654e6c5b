"""Mismatches: ranks that registered, scoped or voted differently are told so on every rank,
at the sync point that sees it.

Every test runs on COMM_SELF (serially) or on every rank of COMM_WORLD (under
``mpiexec -n 4``); the ones that need other ranks are marked ``mpi``. Verdicts
that could differ between ranks are gathered first and asserted on every rank
alike, so that a failing test never leaves some ranks waiting.
"""

from __future__ import annotations

import gc
import time
import zlib
from typing import Any

import pytest
from mpi4py import MPI

import collective_gc as cgc

from _util import (
    TIMEOUT,
    WORLD,
    GcDisabled,
    Obj,
    attempt,
    everyone,
    noop,
    outcome_of,
)


class _Named(cgc.Participant):
    def __init__(self, name: str) -> None:
        self.name = name

    def identity(self) -> str:
        return self.name


def _crc16(text: str) -> int:
    return zlib.crc32(text.encode()) & 0xFFFF  # the fingerprint of issue 25


def _crc16_twin(name: str) -> str:
    """Another identity whose 16-bit CRC is ``name``'s (found by brute force)."""
    want = _crc16(name)
    i = 0
    while True:
        other = f"{name}-twin-{i}"
        if _crc16(other) == want:
            return other
        i += 1


@pytest.mark.mpi(min_size=2)
def test_participants_whose_16_bit_crcs_collide_are_a_mismatch_on_every_rank(
    comm: MPI.Intracomm,
) -> None:
    """Issue 25, defect 6: odd ranks' participant has another identity than
    even ranks', with the same 16-bit CRC: the sync point passed, and a
    participant's collective would then pair with another rank's next one."""
    first = "tests.Named/solver"
    twin = _crc16_twin(first)
    assert twin != first and _crc16(twin) == _crc16(first)
    name = first if comm.Get_rank() % 2 == 0 else twin
    mgr = cgc.manager(comm)
    outcome = "OK"
    try:
        mgr.sync(participants=[_Named(name)], deadline=time.monotonic() + 30)
    except cgc.CollectiveMismatchError as exc:
        outcome = "MISMATCH" if "different participants" in str(exc) else str(exc)
    states = everyone(comm, outcome)
    assert states == ["MISMATCH"] * len(states), states


@pytest.mark.mpi(min_size=2)
def test_mismatch_detected_on_every_rank(comm: MPI.Intracomm) -> None:
    if comm.Get_rank() == 0:
        cgc.register(Obj(), print, comm=comm).detach()  # one extra registration
    with pytest.raises(cgc.CollectiveMismatchError, match="registration counts range from 0 to 1"):
        cgc.collect(comm)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("earlier", [False, True])
def test_registration_on_one_rank_of_a_dup_is_a_mismatch_at_once(
    comm: MPI.Intracomm, earlier: bool
) -> None:
    """Issue 25, defect 7: inside a scope on the parent with timeout=5, one
    rank registers on a ``cgc.dup`` child what the others do not. The
    parent's sync point used to visit the child on that rank only, which then
    waited in the child's agreement until the deadline (for ever without
    one). Now every rank raises CollectiveMismatchError at once, naming the
    child and what each rank registered: the child shares the parent's
    agreement (it is congruent with it), which counts the registrations of
    both. ``earlier``: the child had already been used (and emptied) by
    every rank."""
    rank = comm.Get_rank()
    sub = cgc.dup(comm)
    if earlier:
        o = Obj()
        cgc.register(o, lambda: None, comm=sub, name="shared")
        del o
        cgc.collect(comm, generation=None, timeout=30)
    keep = []
    t0 = time.monotonic()
    with pytest.raises(cgc.CollectiveMismatchError) as info:
        with cgc.collective_scope(comm, timeout=5) as scope:
            if rank == 0:
                o = Obj()
                cgc.register(o, lambda: None, comm=sub, name="only-on-rank-0")
                keep.append(o)
            scope.sync()
    took = time.monotonic() - t0
    text = str(info.value)
    assert "dup #0" in text, text  # the child communicator is named
    assert "only-on-rank-0" in text and "rank 1" in text, text  # and what each rank has
    assert took < 4, f"raised after {took:.1f} s, not at once"
    # The parent and the child share one agreement, whose ranks now number
    # registrations differently: both are unusable, on every rank alike. A
    # fresh communicator (a new family) works.
    child = cgc.manager(sub)
    assert child.broken is not None and cgc.manager(comm).broken is not None
    keep.clear()
    fresh = comm.Dup()
    try:
        o = Obj()
        cgc.register(o, lambda: None, comm=fresh)
        del o
        assert cgc.collect(fresh, generation=None, timeout=30).destroyed == 1
    finally:
        fresh.Free()


@pytest.mark.mpi(min_size=2)
def test_a_registration_mismatch_after_the_window_moved_is_seen_by_every_rank(
    comm: MPI.Intracomm,
) -> None:
    """Rank 0 registers a burst the others do not, with a window sized by earlier
    bursts: every rank raises CollectiveMismatchError (the message lengths stay
    equal), nothing is destroyed, and the manager is unusable everywhere.

    Found by the hostile tests of core v2 (issue 14).
    """
    rank = comm.Get_rank()
    ran: list[int] = []
    with GcDisabled():
        for _ in range(4):
            batch = [Obj() for _ in range(3000)]
            for o in batch:
                cgc.register(o, ran.append, 1, comm=comm)
            del batch, o
            cgc.collect(comm, generation=None, timeout=30)
        ran.clear()
        extra = [Obj() for _ in range(7000 if rank == 0 else 0)]
        regs = [cgc.register(o, ran.append, 2, comm=comm) for o in extra]
        del extra
        seen = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=30))
        for r in regs:
            r.detach()
    mgr = cgc.manager(comm)
    verdict = everyone(comm, (seen, ran, mgr.broken is not None))
    assert verdict == [("CollectiveMismatchError", [], True)] * comm.Get_size(), verdict


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("differ", ["gc", "strict"])
def test_scopes_whose_options_differ_between_ranks_are_a_mismatch_on_every_rank(
    comm: MPI.Intracomm, differ: str
) -> None:
    """Found by a third hostile review of the promise."""
    # gc="managed" adds a participant that may make one more collective;
    # strict=True one that gathers the report. Differing between the ranks,
    # they made collectives on some ranks only (a raw MPI error on one rank,
    # a hang on the others): now the agreement sees it first.
    rank = comm.Get_rank()
    options: dict[str, Any] = (
        {"gc": "managed" if rank == 0 else "auto"}
        if differ == "gc"
        else {"gc": "off", "strict": rank == 0}
    )
    o = Obj()
    o.peer = o  # dies in the cyclic collector: strict mode has something to report
    cgc.register(o, noop, comm=comm, name="x")
    del o
    gc.collect()
    seen: list[str] = []

    def body() -> None:
        with cgc.collective_scope(comm, exit_collect=None, timeout=TIMEOUT, **options) as scope:
            for _ in range(3):
                try:
                    scope.sync()
                    seen.append("ok")
                except cgc.CollectiveMismatchError as exc:
                    seen.append("mismatch" if "different participants" in str(exc) else str(exc))
                    break
                except BaseException as exc:  # noqa: BLE001 (what it must not be)
                    seen.append(type(exc).__name__)
                    break

    # The scope's exit sync point is refused: the manager is unusable.
    left = attempt(body)[0]
    broken = cgc.manager(comm).broken is not None
    states = everyone(comm, (seen, left, broken))
    assert states == [(["mismatch"], "CollectiveGCError", True)] * comm.Get_size(), states
    for reg in cgc.manager(comm).alive() + cgc.manager(comm).pending():
        reg.detach()  # nothing left for the exit agreement of an unusable manager


@pytest.mark.mpi(min_size=3)
def test_mismatch_in_a_derived_communicator_raises_on_every_rank_of_the_parent() -> None:
    """Issue 11, defect 3."""
    parent = WORLD.Dup()
    try:
        rank = parent.Get_rank()
        child = cgc.split(parent, int(rank >= 2))
        keep = [Obj()]
        cgc.register(keep[0], noop, comm=child)
        if rank == 0:
            keep.append(Obj())
            cgc.register(keep[1], noop, comm=child)  # registered on one rank of the child only
        # Ranks 0 and 1 find their child's keys differ; ranks 2 and 3 are not in
        # it. Every rank of the parent must raise, none may wait in its header:
        # the parent's next agreement reports it on all of them.
        cgc.collect(parent, timeout=30)
        with pytest.raises(cgc.DestroyError, match="disagree"):
            cgc.collect(parent, timeout=30)
        assert cgc.collect(parent, timeout=30).destroyed == 0  # the parent goes on
        del child
        assert cgc.collect(parent, timeout=30).destroyed == 1  # and frees the split
    finally:
        parent.Free()


@pytest.mark.mpi(min_size=2)
def test_a_scope_left_early_on_one_rank_is_named_in_the_mismatch(comm: MPI.Intracomm) -> None:
    """An exception that escapes the block on rank 0 only: rank 0 runs the
    scope's exit sync point while the others are at an ordinary one. The
    others get a CollectiveMismatchError, and rank 0's exception a note with
    the same message (the body's exception is the one that propagates): the
    scope ended on rank 0 while the others were still inside it.

    From the fourth hostile round (issue 32, case 7): the message blamed
    gc= or strict= differing between the ranks, or two threads (seen at
    94e03ca)."""
    rank = comm.Get_rank()
    messages: list[str] = []
    try:
        with cgc.collective_scope(comm, exit_collect=None, timeout=TIMEOUT) as scope:
            scope.sync()
            if rank == 0:
                raise RuntimeError("escapes on rank 0 only")
            scope.sync()
    except cgc.CollectiveMismatchError as exc:
        messages.append(str(exc))
    except RuntimeError as exc:
        messages.extend(getattr(exc, "__notes__", []))
    except BaseException as exc:  # noqa: BLE001 (what it must not be)
        messages.append(f"{type(exc).__name__}: {exc}")
    ended = [("ended on rank(s) [0]" in m and "still inside" in m) for m in messages]
    assert everyone(comm, ended) == [[True]] * comm.Get_size(), messages
    assert "gc= or strict=" not in messages[0]
    mgr = cgc.manager(comm)
    for reg in mgr.alive() + mgr.pending():
        reg.detach()
