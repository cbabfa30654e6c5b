"""Hostile tests of core v2 (issue 14): the one-allreduce agreement, its key
window and fallback, deadline words, participants, close, snapshot, the C
registration constructor.

Every test runs on COMM_SELF (serially) or on every rank of COMM_WORLD (under
``mpiexec -n 4``); the ones that need other ranks are marked ``mpi``. Verdicts
that could differ between ranks are gathered first and asserted on every rank
alike, so that a failing (or xfailing) test never leaves some ranks waiting.
A test marked ``xfail(strict=True)`` documents a defect found in review
(/work/notes/review-v2.md): remove the mark with the fix.
"""

from __future__ import annotations

import gc
import os
import random
import signal
import sys
import threading
import time
import tracemalloc
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from mpi4py import MPI

import collective_gc as cgc
from collective_gc import _agree, _registration

from _util import GcDisabled, Obj, same_on_all

WORLD = MPI.COMM_WORLD


def noop(*args: Any) -> None:
    pass


class Token:
    """What a destroy checks: the object it stands for must be dead by then."""

    __slots__ = ("ref", "key", "__weakref__")

    def __init__(self, obj: object) -> None:
        self.ref = weakref.ref(obj)
        self.key = -1


def outcome_of(fn: Any) -> str:
    """Run ``fn``; name what it raised (or "ok")."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 (KeyboardInterrupt included: it is the point)
        return type(exc).__name__
    return "ok"


def everyone(comm: MPI.Comm, value: Any) -> list[Any]:
    """Every rank's ``value`` (over the test's own communicator, not the manager's)."""
    return comm.allgather(value) if comm.Get_size() > 1 else [value]


# -- the window and its fallback: a differential test ---------------------------------


@pytest.fixture(params=["persistent", "iallreduce"])
def agreement_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Agreements made during the test start MPI-4's persistent allreduce
    (where mpi4py offers it: elsewhere both run the other path) or a new
    Iallreduce each time."""
    saved = _agree.PERSISTENT[0]
    _agree.PERSISTENT[0] = request.param == "persistent"
    try:
        yield str(request.param)
    finally:
        _agree.PERSISTENT[0] = saved


def test_the_persistent_path_is_taken_where_mpi4py_offers_it(comm: MPI.Intracomm) -> None:
    agreement = _agree.Agreement(comm)
    try:
        assert (agreement._persistent is not None) == hasattr(comm, "Allreduce_init")
    finally:
        agreement.close()


@pytest.mark.parametrize("seed", [11, 23])
def test_random_drops_destroy_exactly_the_keys_dropped_everywhere(
    comm: MPI.Intracomm, seed: int, agreement_path: str
) -> None:
    """Bursts larger than the window, keys kept for many steps, keys dropped on
    some ranks only: each sync point must destroy exactly the keys every rank
    has dropped (no more: a live object; no fewer: a lost destroy), newest
    first, each once, and only once its object is dead here. The window's
    shape changes often, so a persistent request is remade often."""
    rank = comm.Get_rank()
    shared = random.Random(seed)  # the same draws on every rank: what is registered
    mine = random.Random(seed * 1009 + rank)  # this rank's draws: what it drops
    mgr = cgc.manager(comm)
    held: dict[int, Obj] = {}
    dropped: set[int] = set()
    destroyed: list[int] = []
    fallbacks = [0]
    real = _agree.intersect_any

    def counting(*args: Any) -> Any:
        fallbacks[0] += 1
        return real(*args)

    def destroy(token: Token) -> None:
        assert token.ref() is None, f"destroy of key {token.key}, alive on rank {rank}"
        destroyed.append(token.key)

    _agree.intersect_any = counting  # type: ignore[assignment]
    try:
        with GcDisabled():
            for step in range(36):
                n = shared.choice([0, 1, 3, 40, 300, 700, 2500])
                if step in (12, 25):
                    n = 40_000  # far more than twice any recent interval: outside the window
                for _ in range(n):
                    o = Obj()
                    token = Token(o)
                    reg = cgc.register(o, destroy, token, comm=comm)
                    token.key = reg.key
                    held[reg.key] = o
                o = None
                p = mine.choice([0.0, 0.02, 0.3, 0.7, 1.0])
                if step < 30:
                    # Some keys are kept for ever (until the end): very old keys.
                    for k in [k for k in held if k % 17 and mine.random() < p]:
                        del held[k]
                        dropped.add(k)
                else:
                    for k in list(held):
                        del held[k]
                        dropped.add(k)
                before = len(destroyed)
                stats = cgc.collect(comm, generation=None, timeout=120)
                new = destroyed[before:]
                assert new == sorted(new, reverse=True), "not newest first"
                common = set.intersection(*(set(d) for d in everyone(comm, sorted(dropped))))
                assert len(set(destroyed)) == len(destroyed), "a key destroyed twice"
                assert set(destroyed) == common, (
                    f"step {step}: destroyed {len(destroyed)}, dropped everywhere {len(common)}; "
                    f"extra {sorted(set(destroyed) - common)[:10]}, "
                    f"lost {sorted(common - set(destroyed))[:10]}"
                )
                assert stats.destroyed == len(new)
                assert mgr.broken is None
    finally:
        _agree.intersect_any = real  # type: ignore[assignment]
    held.clear()
    assert cgc.collect(comm, generation=None, timeout=120).pending == 0
    assert mgr.registered == 0
    if comm.Get_size() > 1:
        assert fallbacks[0] > 0, "the fallback round was never exercised"


def _bucket(key: int) -> int:
    return ((key * _agree._HASH) % 2**64) >> 58  # the filter bit _agree._filter sets


@pytest.mark.mpi(min_size=2)
def test_colliding_filter_bits_destroy_nothing_not_pending_everywhere(
    comm: MPI.Intracomm,
) -> None:
    """Two old keys in the same filter bucket, each dropped on different ranks:
    the filter ANDs to nonzero, the fallback round runs, and must find nothing."""
    rank, size = comm.Get_rank(), comm.Get_size()
    log: list[int] = []

    def destroy(token: Token) -> None:
        assert token.ref() is None, f"destroy of key {token.key}, alive on rank {rank}"
        log.append(token.key)

    with GcDisabled():
        old = [Obj() for _ in range(200)]
        regs = []
        for o in old:
            t = Token(o)
            regs.append(cgc.register(o, destroy, t, comm=comm))
            t.key = regs[-1].key
        base = regs[0].key
        # Two keys of the same bucket.
        by_bucket: dict[int, int] = {}
        a = b = -1
        for r in regs:
            other = by_bucket.setdefault(_bucket(r.key), r.key)
            if other != r.key:
                a, b = other, r.key
                break
        assert a >= 0
        # Move the window far beyond the old keys.
        for _ in range(6):
            batch = [Obj() for _ in range(1000)]
            for o in batch:
                cgc.register(o, noop, comm=comm)
            del batch, o
            cgc.collect(comm, generation=None, timeout=60)
        message = cgc.manager(comm).message
        assert message is not None and message[1] > b
        calls = [0]
        real = _agree.intersect_any

        def counting(*args: Any) -> Any:
            calls[0] += 1
            return real(*args)

        _agree.intersect_any = counting  # type: ignore[assignment]
        try:
            drop = {0: [a], 1: [b]}.get(rank, [a, b])
            for k in drop:
                old[k - base] = None  # type: ignore[call-overload]
            stats = cgc.collect(comm, generation=None, timeout=60)
            assert stats.destroyed == 0 and log == []
            assert calls[0] == 1, "the colliding filter bits did not start the fallback"
            # Now every rank drops both: both go, newest first.
            old[a - base] = old[b - base] = None  # type: ignore[call-overload]
            stats = cgc.collect(comm, generation=None, timeout=60)
        finally:
            _agree.intersect_any = real  # type: ignore[assignment]
    assert log == [b, a] and stats.destroyed == 2
    assert size == len(everyone(comm, log))
    del old
    cgc.collect(comm, generation=None, timeout=60)


class _Tiny:
    __slots__ = ("__weakref__",)


def test_a_burst_beyond_the_window_limit_with_old_keys(comm: MPI.Intracomm) -> None:
    """More than Window.LIMIT (2**20) keys dropped at once, plus keys older than
    any window, some dropped on one rank only."""
    rank = comm.Get_rank()
    n = _agree.Window.LIMIT + 5000
    count = [0]

    def destroy() -> None:
        count[0] += 1

    with GcDisabled():
        old = [_Tiny() for _ in range(100)]
        old_regs = [cgc.register(o, destroy, comm=comm) for o in old]
        cgc.collect(comm, generation=None, timeout=60)
        objs = [_Tiny() for _ in range(n)]
        mgr = cgc.manager(comm)
        for o in objs:
            mgr.register(o, destroy, (), {}, None)
        o = None
        # The old keys: even ones dropped everywhere, odd ones on rank 0 only.
        for i in range(0, 100, 2):
            old[i] = None  # type: ignore[call-overload]
        if rank == 0:
            for i in range(1, 100, 2):
                old[i] = None  # type: ignore[call-overload]
        del objs
        stats = cgc.collect(comm, generation=None, timeout=300)
    expected = n + (100 if comm.Get_size() == 1 else 50)
    assert stats.destroyed == expected == count[0]
    alive_odd = [r.alive for r in old_regs[1::2]]
    assert alive_odd == [comm.Get_size() > 1] * 50
    del old
    assert cgc.collect(comm, generation=None, timeout=60).pending == 0
    assert mgr.registered == 0


# -- explicit destroys, detaches, refused registrations keep the ranks in step ----------


def test_a_registration_refused_inside_a_destroy_keeps_keys_in_step(
    comm: MPI.Intracomm,
) -> None:
    rank = comm.Get_rank()
    made: list[str] = []

    def destroy(tag: str) -> None:
        # Refused on every rank: the key counter must not move anywhere.
        cgc.register(Obj(), noop, comm=comm)
        made.append(tag)

    mgr = cgc.manager(comm)
    with GcDisabled():
        objs = [Obj() for _ in range(500)]
        for i, o in enumerate(objs):
            cgc.register(o, destroy if i == 7 else noop, str(i), comm=comm)
        del objs, o
        before = mgr.next_key
        with pytest.raises(cgc.DestroyError, match="from inside a destroy") as info:
            cgc.collect(comm, generation=None, timeout=60)
        assert {r for r, *_ in info.value.failures} == set(range(comm.Get_size()))
        assert mgr.next_key == before and made == []
        assert everyone(comm, (mgr.next_key, mgr.sync_count)) == [(before, 1)] * comm.Get_size()
        # The window moved alike on every rank: the next sync points agree.
        for _ in range(3):
            batch = [Obj() for _ in range(700)]
            for o in batch:
                cgc.register(o, noop, comm=comm)
            del batch, o
            assert cgc.collect(comm, generation=None, timeout=60).destroyed == 700
    assert mgr.broken is None, rank


def test_explicit_destroys_and_detaches_of_queued_old_keys(comm: MPI.Intracomm) -> None:
    """Old keys (outside the window) queued on some ranks only, then destroyed
    explicitly (collectively) or detached everywhere: never destroyed twice,
    never by a sync point afterwards."""
    rank = comm.Get_rank()
    runs: dict[int, int] = {}

    def destroy(token: Token) -> None:
        runs[token.key] = runs.get(token.key, 0) + 1

    with GcDisabled():
        keep = [Obj() for _ in range(40)]
        regs = []
        for o in keep:
            t = Token(o)
            regs.append(cgc.register(o, destroy, t, comm=comm))
            t.key = regs[-1].key
        for _ in range(5):
            batch = [Obj() for _ in range(600)]
            for o in batch:
                cgc.register(o, noop, comm=comm)
            del batch, o
            cgc.collect(comm, generation=None, timeout=60)
        if rank == 0 and comm.Get_size() > 1:
            for i in range(0, 40, 2):
                keep[i] = None  # type: ignore[call-overload]
        cgc.collect(comm, generation=None, timeout=60)  # queued on rank 0 only
        for r in regs[0:20:2]:
            r.destroy()  # collective: every rank
        for r in regs[20:40:2]:
            assert r.detach()
        for i in range(0, 40, 2):
            keep[i] = None  # type: ignore[call-overload]
        stats = cgc.collect(comm, generation=None, timeout=60)
        assert stats.destroyed == 0
        assert cgc.pending(comm) == []
        del keep
        stats = cgc.collect(comm, generation=None, timeout=60)
    assert stats.destroyed == 20
    assert runs == {r.key: 1 for r in regs[0:20:2] + regs[1::2]}


# -- deadlines ---------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_a_huge_timeout_is_either_refused_up_front_or_works(comm: MPI.Intracomm) -> None:
    o = Obj()
    reg = cgc.register(o, noop, comm=comm)
    del o
    seen = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=1e13))
    seen_all = everyone(comm, (seen, cgc.manager(comm).broken is None))
    reg.detach()  # nothing left for the exit agreement of a broken manager
    # Either refused before any collective (ValueError, manager usable) or done.
    assert all(s == ("ok", True) for s in seen_all) or all(
        s == ("ValueError", True) for s in seen_all
    ), seen_all


@pytest.mark.mpi(min_size=2)
def test_a_late_rank_in_the_error_check_raises_timeout_too(comm: MPI.Intracomm) -> None:
    """Only rank 0 has a deadline; rank 1's destroy is slow, so rank 0 gives up in
    the second collective (the error check). Ranks without a deadline that
    complete it afterwards must raise CollectiveTimeoutError too."""
    rank = comm.Get_rank()

    def destroy() -> None:
        if rank == 1:
            time.sleep(2.5)

    o = Obj()
    cgc.register(o, destroy, comm=comm)
    cgc.collect(comm, generation=None, timeout=30)
    del o
    t0 = time.monotonic()
    seen = outcome_of(
        lambda: cgc.collect(comm, generation=None, timeout=1.0 if rank == 0 else None)
    )
    took = time.monotonic() - t0
    seen_all = everyone(comm, seen)
    assert seen_all == ["CollectiveTimeoutError"] * comm.Get_size(), seen_all
    assert took < 10
    after = everyone(comm, outcome_of(lambda: cgc.collect(comm, timeout=5)))
    assert after == ["CollectiveGCError"] * comm.Get_size(), after


@pytest.mark.mpi(min_size=2)
def test_deadline_words_mixed_with_and_without_timeouts_in_step(comm: MPI.Intracomm) -> None:
    """Ranks alternate having a deadline; nobody is late: every sync point works."""
    rank = comm.Get_rank()
    for i in range(20):
        o = Obj()
        cgc.register(o, noop, comm=comm)
        del o
        timeout = 30.0 if (i + rank) % 2 else None
        assert cgc.collect(comm, generation=None, timeout=timeout).destroyed == 1


@pytest.mark.mpi(min_size=2)
def test_a_late_rank_in_manager_allgather_raises_at_once(comm: MPI.Intracomm) -> None:
    rank = comm.Get_rank()
    mgr = cgc.manager(comm)
    cgc.collect(comm, timeout=30)  # the private duplicate exists everywhere
    if rank == 1:
        time.sleep(2.0)
    t0 = time.monotonic()
    seen = outcome_of(lambda: mgr.allgather(rank, timeout=0.5 if rank == 0 else 8.0))
    took = time.monotonic() - t0
    seen_all = everyone(comm, (seen, took < 4.0 or rank == 0))
    # As at a sync point: every rank raises CollectiveTimeoutError, and the ones
    # that complete the abandoned gather learn it at once, not at their own deadline.
    assert seen_all == [("CollectiveTimeoutError", True)] * comm.Get_size(), seen_all


# -- interrupts inside the agreement's wait ------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("timeout", [8.0, None])
def test_an_interrupt_in_the_agreement_wait_leaves_every_rank_alike(
    comm: MPI.Intracomm, timeout: float | None
) -> None:
    # ``timeout`` is rank 0's (None: the in-place Wait path, where the signal's
    # handler runs as soon as Wait returns); the others always have one, or this
    # test would hang them: with none they wait for ever in the error check.
    rank = comm.Get_rank()
    log: list[int] = []
    o = Obj()
    reg = cgc.register(o, log.append, 1, comm=comm)
    cgc.collect(comm, generation=None, timeout=30)
    del o
    mgr = cgc.manager(comm)

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    if rank == 0:
        previous = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            seen = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=timeout))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    else:
        time.sleep(1.5)  # rank 0 is waiting (or polling) for us meanwhile
        seen = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=8.0))
    state = (seen, mgr.broken, log)
    states = everyone(comm, state)
    if mgr.broken is not None and reg.alive:
        reg.detach()  # nothing left here for the exit agreement
    # The interrupt is held until the sync point's collectives are done, then
    # raised on rank 0 only: every rank ran the same destroys (a collective
    # destroy run on some ranks only hangs them), and the manager is usable
    # everywhere, so the next sync point is in step.
    assert [s[0] for s in states] == ["KeyboardInterrupt"] + ["ok"] * (len(states) - 1), states
    assert all(s[1] is None and s[2] == [1] for s in states), states
    assert cgc.collect(comm, generation=None, timeout=30).sync == mgr.sync_count - 1


def _interrupted_then_failed(
    comm: MPI.Intracomm, sync: Any, late_sync: Any
) -> tuple[str, str, bool]:
    """Rank 0 runs ``sync`` and gets a KeyboardInterrupt 0.3 s into its wait;
    the other ranks arrive 1.5 s later and run ``late_sync``. What each rank
    raised, what that had as its context, and whether the manager is broken."""
    rank = comm.Get_rank()
    o = Obj()
    reg = cgc.register(o, noop, comm=comm)
    cgc.collect(comm, generation=None, timeout=30)
    mgr = cgc.manager(comm)

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    raised: BaseException | None = None
    if rank == 0:
        previous = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            sync()
        except BaseException as exc:  # noqa: BLE001 (KeyboardInterrupt included: it is the point)
            raised = exc
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    else:
        time.sleep(1.5)  # rank 0 is waiting (or polling) for us meanwhile
        try:
            late_sync()
        except BaseException as exc:  # noqa: BLE001
            raised = exc
    if mgr.broken is not None and reg.alive:
        reg.detach()  # nothing left here for the exit agreement
    del o
    context = None if raised is None else raised.__context__
    return type(raised).__name__, type(context).__name__, mgr.broken is not None


@pytest.mark.mpi(min_size=2)
def test_an_interrupt_held_in_a_wait_that_then_times_out_is_raised_not_lost(
    comm: MPI.Intracomm,
) -> None:
    # Rank 0's wait holds the interrupt, then its deadline passes: the
    # interrupt (what the user asked for) is raised, the timeout its context;
    # the late ranks see the timeout. Every manager is unusable.
    states = everyone(
        comm,
        _interrupted_then_failed(
            comm,
            lambda: cgc.collect(comm, generation=None, timeout=0.8),
            lambda: cgc.collect(comm, generation=None, timeout=8.0),
        ),
    )
    assert states == [("KeyboardInterrupt", "CollectiveTimeoutError", True)] + [
        ("CollectiveTimeoutError", "NoneType", True)
    ] * (len(states) - 1), states


@pytest.mark.mpi(min_size=2)
def test_an_interrupt_held_in_a_wait_that_then_finds_a_mismatch_is_raised_not_lost(
    comm: MPI.Intracomm,
) -> None:
    # Rank 0 is at the exit agreement, the others at a sync point: every rank
    # raises CollectiveMismatchError, except that rank 0's held interrupt is
    # raised instead, with the mismatch as its context.
    mgr = cgc.manager(comm)
    states = everyone(
        comm,
        _interrupted_then_failed(
            comm,
            lambda: mgr.sync(at_exit=True, deadline=time.monotonic() + 30),
            lambda: cgc.collect(comm, generation=None, timeout=30),
        ),
    )
    assert states == [("KeyboardInterrupt", "CollectiveMismatchError", True)] + [
        ("CollectiveMismatchError", "NoneType", True)
    ] * (len(states) - 1), states


# -- participants ------------------------------------------------------------------------


class _Recorder(cgc.Participant):
    def __init__(self, field: int, vote: int) -> None:
        self.field = field
        self._vote = vote
        self.seen: list[int] = []

    def vote(self, mgr: cgc.Manager) -> int:
        return self._vote

    def finish(self, mgr: cgc.Manager, flags: int) -> None:
        self.seen.append(self.votes(flags))


@pytest.mark.parametrize("vote", [256, -1, 1 << 40])
def test_a_vote_out_of_range_is_a_clear_error(comm: MPI.Intracomm, vote: int) -> None:
    mgr = cgc.manager(comm)
    p = _Recorder(5, vote)
    mgr.add_participant(p)
    seen = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=30))
    seen_all = everyone(comm, seen)
    assert seen_all[0] in ("ValueError", "CollectiveGCError"), (seen_all, p.seen)


@pytest.mark.mpi(min_size=2)
def test_an_interrupt_held_in_a_wait_that_then_finds_a_bad_vote_is_raised_not_lost(
    comm: MPI.Intracomm,
) -> None:
    # Every rank refuses the out-of-range vote and keeps its manager; rank 0
    # raises its held interrupt instead, with the refusal as its context.
    mgr = cgc.manager(comm)

    def sync() -> None:
        mgr.add_participant(_Recorder(5, 256))  # on every rank alike, before its sync point
        cgc.collect(comm, generation=None, timeout=30)

    states = everyone(comm, _interrupted_then_failed(comm, sync, sync))
    # Its participant votes out of range for good: nothing is left for the
    # exit agreement, which it would refuse too.
    for reg in mgr.alive() + mgr.pending():
        reg.detach()
    mgr.mark_unusable("the end of this test: a participant votes out of range")
    assert states == [("KeyboardInterrupt", "CollectiveGCError", False)] + [
        ("CollectiveGCError", "NoneType", False)
    ] * (len(states) - 1), states


def test_a_participant_in_the_scope_policy_field_is_refused_or_kept_apart(
    comm: MPI.Intracomm,
) -> None:
    mgr = cgc.manager(comm)
    p = _Recorder(0, 0x80)
    mgr.add_participant(p)
    with cgc.collective_scope(comm, gc="managed", exit_collect=None) as scope:
        try:
            scope.sync()
            seen = "ok"
        except cgc.CollectiveGCError as exc:
            seen = "refused" if "field" in str(exc) else "other"
        full = scope.collections
    # Either the clash is refused, or each participant reads only its own votes
    # (no collection: nothing was allocated to ask for one).
    verdict = everyone(comm, (seen, p.seen, full))
    assert all(v[0] == "refused" for v in verdict) or all(
        v == ("ok", [0x80, 0x80], 0) for v in verdict
    ), verdict


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("with_failure", [False, True])
def test_a_finish_raising_on_one_rank_is_seen_alike(
    comm: MPI.Intracomm, with_failure: bool
) -> None:
    rank = comm.Get_rank()

    class Fragile(cgc.Participant):
        def finish(self, mgr: cgc.Manager, flags: int) -> None:
            if rank == 0:
                raise RuntimeError("finish failed on rank 0")

    def fails() -> None:
        raise ValueError("destroy failed")

    mgr = cgc.manager(comm)
    o = Obj()
    cgc.register(o, fails if with_failure else noop, comm=comm)
    cgc.collect(comm, generation=None, timeout=30)
    del o
    mgr.add_participant(Fragile())
    seen = outcome_of(lambda: cgc.collect(comm, generation=None, timeout=3))
    verdict = everyone(comm, (seen, mgr.broken is None))
    assert all(v == verdict[0] for v in verdict) and verdict[0][0] != "ok", verdict


class _Finisher(cgc.Participant):
    """A finish that raises ``exc`` on ``rank`` (``may`` answers may_raise),
    and logs each call."""

    def __init__(self, tag: str, rank: int, exc: BaseException | None, may: bool) -> None:
        self.tag, self.rank, self.exc, self.may = tag, rank, exc, may

    def may_raise(self, flags: int) -> bool:
        return self.may

    def finish(self, mgr: cgc.Manager, flags: int) -> None:
        _FINISHED.append(self.tag)
        if self.exc is not None and mgr.rank == self.rank:
            raise self.exc


_FINISHED: list[str] = []


def _sync_with(mgr: cgc.Manager, *parts: cgc.Participant) -> object:
    """One sync point of ``mgr`` with ``parts`` as its own participants, the
    finish log emptied first."""
    _FINISHED.clear()
    return mgr.sync(deadline=time.monotonic() + 30, participants=parts)


@pytest.mark.mpi(min_size=2)
def test_an_interrupt_in_a_finish_is_its_rank_s_and_a_destroy_error_elsewhere(
    comm: MPI.Intracomm,
) -> None:
    rank = comm.Get_rank()
    mgr = cgc.manager(comm)
    o = Obj()
    cgc.register(o, noop, comm=comm)
    del o
    first = _Finisher("first", 1, KeyboardInterrupt(), True)
    second = _Finisher("second", -1, None, False)
    text = ""
    try:
        # With a destroy to run, so the error check comes before the finishes.
        _sync_with(mgr, first, second)
    except BaseException as exc:  # noqa: BLE001 (the interrupt is the point)
        text = f"{type(exc).__name__}: {exc} {getattr(exc, '__notes__', '')}"
    seen = "ok" if mgr.destroyed == 1 else f"destroyed {mgr.destroyed}"
    verdict = everyone(comm, (seen, text.split(":")[0], list(_FINISHED), mgr.broken))
    # Every participant finished on every rank, the sync point's collectives
    # were all made, rank 1 got its interrupt back and the others a
    # DestroyError naming it; the manager stays usable everywhere.
    assert all(v[0] == "ok" and v[2] == ["first", "second"] and v[3] is None for v in verdict), (
        verdict
    )
    assert [v[1] for v in verdict] == [
        "KeyboardInterrupt" if r == 1 else "DestroyError" for r in range(len(verdict))
    ], verdict
    if rank != 1:
        assert "the finish of _Finisher" in text and "KeyboardInterrupt" in text, text
    assert cgc.collect(comm, generation=None, timeout=30).sync == mgr.sync_count - 1


def test_a_finish_raising_on_rank_0_is_a_destroy_error_on_every_rank(
    comm: MPI.Intracomm,
) -> None:
    # On any size, one rank included: the same report as a destroy's.
    mgr = cgc.manager(comm)
    fragile = _Finisher("fragile", 0, ValueError("finish failed"), True)
    after = _Finisher("after", -1, None, False)
    failures: Any = None
    try:
        _sync_with(mgr, fragile, after)
    except cgc.DestroyError as exc:
        failures = exc.failures
        del exc
    verdict = everyone(comm, (failures, list(_FINISHED), mgr.broken))
    expected = [(0, -1, "the finish of _Finisher", "ValueError: finish failed")]
    assert all(v == (expected, ["fragile", "after"], None) for v in verdict), verdict
    assert cgc.collect(comm, generation=None, timeout=30).destroyed == 0


def test_a_finish_that_said_it_would_not_raise_raises_on_its_rank_only(
    comm: MPI.Intracomm,
) -> None:
    mgr = cgc.manager(comm)
    liar = _Finisher("liar", 0, ValueError("unexpected"), False)
    after = _Finisher("after", -1, None, False)
    seen = outcome_of(lambda: _sync_with(mgr, liar, after))
    verdict = everyone(comm, (seen, list(_FINISHED), mgr.broken))
    # No collective was left half-way: the others returned, and every rank is
    # in step for the next sync point.
    assert [v[0] for v in verdict] == ["ValueError"] + ["ok"] * (len(verdict) - 1), verdict
    assert all(v[1] == ["liar", "after"] and v[2] is None for v in verdict), verdict
    assert cgc.collect(comm, generation=None, timeout=30).destroyed == 0


class _Asked(_Finisher):
    """may_raise raises ``exc`` on ``rank`` the first time it is asked."""

    def __init__(self, rank: int, exc: BaseException) -> None:
        super().__init__("asked", -1, None, True)
        self.pending: BaseException | None = exc
        self.asked_rank = rank
        self.asked = 0

    def may_raise(self, flags: int) -> bool:
        self.asked += 1
        exc, self.pending = self.pending, None
        if exc is not None and self.asked_rank in (-1, WORLD.Get_rank()):
            raise exc
        return True


@pytest.mark.mpi(min_size=2)
def test_a_may_raise_raising_keyboardinterrupt_is_its_rank_s_and_a_destroy_error_elsewhere(
    comm: MPI.Intracomm,
) -> None:
    # Issue 25: a signal's KeyboardInterrupt can no longer land in may_raise
    # (the sync point is a protected region, see test_interrupts.py), so one
    # that may_raise raises is its own code's: a yes and a failure, as from a
    # finish (it was held and the question asked again).
    mgr = cgc.manager(comm)
    asked = _Asked(1, KeyboardInterrupt())
    seen = outcome_of(lambda: _sync_with(mgr, asked))
    verdict = everyone(comm, (seen, asked.asked, list(_FINISHED), mgr.broken))
    assert [v[0] for v in verdict] == [
        "KeyboardInterrupt" if r == 1 else "DestroyError" for r in range(len(verdict))
    ], verdict
    assert all(v[1] == 1 and v[2] == ["asked"] and v[3] is None for v in verdict), verdict
    assert cgc.collect(comm, generation=None, timeout=30).sync == mgr.sync_count - 1


@pytest.mark.mpi(min_size=2)
def test_a_may_raise_that_raises_is_a_yes_and_an_error_on_every_rank(
    comm: MPI.Intracomm,
) -> None:
    mgr = cgc.manager(comm)
    asked = _Asked(-1, ValueError("may_raise is broken"))
    failures: Any = None
    try:
        _sync_with(mgr, asked)
    except cgc.DestroyError as exc:
        failures = [(r, k, n) for r, k, n, _ in exc.failures]
        del exc
    verdict = everyone(comm, (failures, list(_FINISHED), mgr.broken))
    expected = [(r, -1, "the may_raise of _Asked") for r in range(comm.Get_size())]
    assert all(v == (expected, ["asked"], None) for v in verdict), verdict


@pytest.mark.mpi(min_size=2)
def test_a_quiet_scope_sync_point_makes_no_finish_check(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scope's own participants (its policy, strict mode's flags, derived
    # communicators) say may_raise only when they run code that can raise:
    # a sync point that neither destroys nor collects stays one collective.
    checks: list[int] = []
    real = _agree.Agreement.any_flags

    def counted(self: _agree.Agreement, *args: Any, **kwargs: Any) -> int:
        checks.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(_agree.Agreement, "any_flags", counted)
    cgc.dup(comm).Free()  # a derived communicator: its participant is on the manager
    with cgc.collective_scope(comm, gc="managed", strict=True, exit_collect=None, timeout=30) as s:
        s.sync()
        gc.collect()  # nothing is due to the collector now: no rank votes for a collection
        before = len(checks)
        for _ in range(5):
            s.sync()
        after = len(checks)
    assert same_on_all(comm, (before, after))
    assert after == before, (before, after)


def test_a_participant_that_does_not_override_finish_adds_no_collective() -> None:
    class Voter(cgc.Participant):
        field = 3

    assert not Voter().may_raise(0)
    assert _Finisher("x", 0, None, True).may_raise(0)
    assert cgc.Participant.may_raise(_Recorder(0, 0), 0)  # it overrides finish


def test_two_nested_managed_scopes_on_one_comm(comm: MPI.Intracomm) -> None:
    mgr = cgc.manager(comm)
    o = Obj()
    cgc.register(o, noop, comm=comm)
    before = mgr.participants  # the derived-communicator visitor, since its first collective
    with cgc.collective_scope(comm, gc="managed", timeout=30) as outer:
        with cgc.collective_scope(comm, gc="managed", strict=True, timeout=30) as inner:
            junk = [[] for _ in range(5000)]  # the collector's counts ask for a collection
            del junk, o
            assert inner.sync().destroyed == 1
            assert cgc.current_scope(comm) is inner
        outer.sync()
        assert cgc.current_scope(comm) is outer
    assert cgc.current_scope(comm) is None
    assert mgr.broken is None and mgr.participants == before  # the scopes left none


# -- close and snapshot ------------------------------------------------------------------


def test_close_after_a_failed_last_sync_point_then_reuse(comm: MPI.Intracomm) -> None:
    rank = comm.Get_rank()
    ran: list[str] = []

    def fails(tag: str) -> None:
        ran.append(tag)
        raise ValueError(tag)

    mgr = cgc.manager(comm)
    a, b, c = Obj(), Obj(), Obj()
    cgc.register(a, fails, "a", comm=comm)
    rb = cgc.register(b, ran.append, "b", comm=comm)
    rc = cgc.register(c, ran.append, "c", comm=comm)
    del a
    if rank == 0:
        del b  # queued on rank 0 only
    with pytest.raises(cgc.DestroyError):
        mgr.close(timeout=30)
    assert mgr.broken is None  # the close did not happen: its sync point raised
    with pytest.warns(cgc.ExitLeakWarning):
        mgr.close(timeout=30)
    solo = comm.Get_size() == 1
    assert ran == (["b", "a"] if solo else ["a"])
    assert not rb.alive and not rc.alive
    assert rb.state == ("destroyed" if solo else "detached") and rc.state == "detached"
    with pytest.raises(cgc.CollectiveGCError, match="closed"):
        cgc.collect(comm, timeout=30)
    with pytest.raises(cgc.CollectiveGCError, match="closed"):
        cgc.register(Obj(), noop, comm=comm)
    del c
    if rank != 0:
        del b
    gc.collect()
    assert ran == (["b", "a"] if solo else ["a"])  # detached: b's and c's finalizers did nothing
    assert mgr.pending() == []


def test_snapshot_from_another_thread_during_sync_points(comm: MPI.Intracomm) -> None:
    mgr = cgc.manager(comm)
    stop = threading.Event()
    errors: list[BaseException] = []
    inside = threading.Event()
    go_on = threading.Event()
    snaps: list[Any] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                during = inside.is_set() and not go_on.is_set()  # before the snapshot
                snap = mgr.snapshot()
                keys = [r.key for r in snap.pending]
                assert keys == sorted(set(keys)), keys
                if during:
                    snaps.append(snap)
                    go_on.set()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def blocking() -> None:
        inside.set()
        assert go_on.wait(30)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        with GcDisabled():
            for step in range(30):
                objs = [Obj() for _ in range(400)]
                regs = [cgc.register(o, noop, comm=comm) for o in objs]
                if step == 15:
                    special = Obj()
                    sreg = cgc.register(special, blocking, comm=comm)
                    del special
                del objs[::2]
                cgc.collect(comm, generation=None, timeout=60)
                del objs, regs
        cgc.collect(comm, generation=None, timeout=60)
    finally:
        stop.set()
        go_on.set()
        t.join(30)
    assert not errors, errors
    assert snaps, "the reader never saw the sync point with the blocking destroy"
    # Taken while the agreed destroys ran: none of them is pending any more.
    assert sreg.key not in [r.key for r in snaps[0].pending]
    assert not sreg.alive


# -- the C registration constructor and the finalizer -----------------------------------


class _Slotted(Obj):
    __slots__ = ("extra",)


class _NoWeak:
    __slots__ = ("a",)


class _NoWeakSub(_NoWeak):
    __slots__ = ("b",)


class _WeakSlots:
    __slots__ = ("a", "__weakref__")


@pytest.mark.parametrize("kind", ["c", "python"])
def test_objects_that_cannot_be_weakly_referenced_take_no_key(kind: str) -> None:
    comm = MPI.COMM_SELF.Dup()
    _registration.use_speedups(kind)
    try:
        mgr = cgc.manager(comm)
        for bad in (3, (1, 2), [1], _NoWeak(), _NoWeakSub(), "s"):
            with pytest.raises(cgc.RegistrationError, match="weakly referenced"):
                cgc.register(bad, noop, comm=comm)
        assert mgr.next_key == 0 and mgr.registered == 0
        ok = _WeakSlots()
        reg = cgc.register(ok, noop, comm=comm)
        sub = _Slotted()
        reg2 = cgc.register(sub, noop, comm=comm)
        assert (reg.key, reg.typename, reg2.key, reg2.typename) == (0, "_WeakSlots", 1, "_Slotted")
        del ok, sub
        assert cgc.collect(comm, generation=None).destroyed == 2
    finally:
        _registration.use_speedups("c")
        cgc.manager(comm).close()
        comm.Free()


def test_the_c_constructor_keeps_no_reference_it_does_not_own() -> None:
    """Refcounts of everything new_registration stores go back to where they were."""
    assert _registration.SPEEDUPS is not None
    comm = MPI.COMM_SELF.Dup()
    try:

        class Named:  # a heap type: PyType_GetName gives a new reference to its name
            pass

        def destroy(*args: Any) -> None:
            pass

        args = (object(), object())
        name = "".join(["a", "name", str(os.getpid())])  # not interned
        counts = lambda: (  # noqa: E731
            sys.getrefcount(destroy),
            sys.getrefcount(args),
            sys.getrefcount(name),
            sys.getrefcount(Named.__name__),
            sys.getrefcount(Named),
        )
        cgc.collect(comm, generation=None)
        before = counts()
        for _ in range(3):
            objs = [Named() for _ in range(1000)]
            regs = [cgc.register(o, destroy, *args, comm=comm, name=name) for o in objs]
            regs += [cgc.register(Obj(), destroy, *args, comm=comm) for _ in range(10)]
            del objs
            assert cgc.collect(comm, generation=None).destroyed == 1010
            del regs
        gc.collect()
        assert counts() == before
    finally:
        cgc.manager(comm).close()
        comm.Free()


@pytest.mark.parametrize("kind", ["c", "python"])
def test_a_million_registrations_do_not_grow_memory(kind: str) -> None:
    comm = MPI.COMM_SELF.Dup()
    _registration.use_speedups(kind)

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    try:
        mgr = cgc.manager(comm)
        chunk = 100_000

        def rounds(n: int) -> None:
            for _ in range(n):
                for _ in range(chunk):
                    o = _Tiny()
                    mgr.register(o, noop, (), {}, None)
                o = None
                assert cgc.collect(comm, generation=None).destroyed == chunk

        with GcDisabled():
            rounds(2)  # warm up: the dicts and arrays at their working size
            r0 = rss()
            rounds(5)
            rgrown = rss() - r0
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            rounds(3)
            grown = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
        assert mgr.next_key == 10 * chunk and mgr.registered == 0
        assert grown < 2_000_000, grown
        assert rgrown < 32_000_000, rgrown
    finally:
        _registration.use_speedups("c")
        cgc.manager(comm).close()
        comm.Free()


def test_finalizers_after_close_or_after_the_manager_is_forgotten_do_nothing() -> None:
    comm = MPI.COMM_SELF.Dup()
    try:
        mgr = cgc.manager(comm)
        ran: list[int] = []
        objs = [Obj() for _ in range(100)]
        regs = [cgc.register(o, ran.append, i, comm=comm) for i, o in enumerate(objs)]
        with pytest.warns(cgc.ExitLeakWarning, match="100 registration"):
            mgr.close()
        del objs
        gc.collect()
        assert ran == [] and all(r.state == "detached" for r in regs)
        assert mgr.pending() == [] and mgr.registered == 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mgr.close()
    finally:
        comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_registration_mismatch_after_the_window_moved_is_seen_by_every_rank(
    comm: MPI.Intracomm,
) -> None:
    """Rank 0 registers a burst the others do not, with a window sized by earlier
    bursts: every rank raises CollectiveMismatchError (the message lengths stay
    equal), nothing is destroyed, and the manager is unusable everywhere."""
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
