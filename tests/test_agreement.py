"""The agreement: the key window and its fallback, its message, the persistent and the
Iallreduce paths, old keys pending on some ranks, the fallback intersection (issue 25,
defect 4 and "Scale").

The same file runs serially and on 4 ranks; the message-size test starts its
own jobs of 2, 4 and 16 ranks (marked ``launcher``, from the serial session).
"""

from __future__ import annotations

import gc
import random
import re
import subprocess
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import collective_gc as cgc
import collective_gc.testing as cgc_testing
from collective_gc import _agree, _transport

from _util import (
    CheckedLog,
    GcDisabled,
    Obj,
    Tiny,
    everyone,
    noop,
)
from conftest import mpiexec_cmd, mpiexec_env

JOBS = Path(__file__).parent / "jobs"


def test_the_message_layout_is_independent_of_the_number_of_ranks() -> None:
    """At most 16 words beyond the key window, whatever the communicator."""
    for bits in (_agree.WINDOW_MIN, 4096, _agree.WINDOW_LIMIT):
        words = _agree.message_words(bits)
        assert words - bits // 64 <= 16, words


@pytest.mark.launcher
def test_the_empty_sync_points_message_is_the_same_at_2_4_and_16_ranks() -> None:
    """Issue 25, Scale: the agreement carried a deadline word per rank (6 + p +
    window words). The job prints the length of the message each of its sync
    points sent; it must not depend on the job's size."""
    seen = {}
    for n in (2, 4, 16):
        proc = subprocess.run(
            [*mpiexec_cmd(n, 120), sys.executable, "-m", "mpi4py", str(JOBS / "message_words.py")],
            capture_output=True,
            text=True,
            timeout=150,
            env=mpiexec_env(),
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = re.findall(r"words (\d+) (\d+) ([\d ]+)", proc.stdout)
        assert len(lines) == n, proc.stdout
        per_rank = {(int(size), words) for size, _, words in lines}
        assert len(per_rank) == 1, per_rank  # every rank sent the same
        size, words = per_rank.pop()
        assert size == n
        seen[n] = [int(w) for w in words.split()]
    assert seen[2] == seen[4] == seen[16], seen
    empty = seen[2][0]
    assert empty == _agree.message_words(_agree.WINDOW_MIN), seen


def _own_subset(rank: int, keys: np.ndarray[Any, Any], keep: float) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(1000 + rank)
    return np.sort(rng.choice(keys, size=int(keys.size * keep), replace=False))


def _holding(rank: int, keys: np.ndarray[Any, Any], keep: float) -> np.ndarray[Any, Any]:
    """What rank ``rank`` holds of ``keys``: all of them (keep 1), none on rank
    0 and 90% elsewhere (keep 0), else its own part."""
    if keep == 1.0:
        return keys
    if keep == 0.0:
        return keys[:0] if rank == 0 else _own_subset(rank, keys, 0.9)
    return _own_subset(rank, keys, keep)


@pytest.mark.parametrize(
    "spread, count, keep",
    [
        (600_000, 10_000, 0.9),  # issue 25's pattern: a 64+ KiB merge on 4 ranks
        (10**12, 3, 0.7),  # a few keys far apart
        (20_000, 10_000, 0.95),  # dense: a bitmap over their range
        (600_000, 10_000, 0.0),  # a rank with none
        (600_000, 10_000, 1.0),  # the same keys everywhere
    ],
)
def test_the_fallback_intersection_is_exact(
    comm: MPI.Intracomm, spread: int, count: int, keep: float
) -> None:
    """Issue 25, defect 4: sorted keys spread over a wide range, each rank
    holding a different part: the intersection was an Iallreduce of one 64+
    KiB element with a Python user-defined op, which Open MPI 4.1's libnbc
    ring called on an empty segment (IndexError, MPI_ABORT)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    all_keys = np.unique(np.random.default_rng(7).integers(0, spread, size=count))
    mine = _holding(rank, all_keys, keep)
    got = _agree.intersect_any(comm, mine, _transport.Deadline(time.monotonic() + 60), lambda: "")
    want = set(mine.tolist())
    for r in range(size):
        want &= set(_holding(r, all_keys, keep).tolist())
    assert got.dtype == np.int64
    assert got.tolist() == sorted(want)
    assert everyone(comm, got.tolist()) == [got.tolist()] * size


_COUNT = [0]


def _count() -> None:  # a module-level function: the C registration path
    _COUNT[0] += 1


def test_sparse_long_lived_keys_dropped_on_different_ranks(comm: MPI.Intracomm) -> None:
    """Issue 25, defect 4, end to end: 600,000 registrations of which 1 in 60
    are kept (10,000 long-lived keys spread over the range, all outside the
    key window), then each rank drops a different 90% of them: the job
    aborted in the fallback's merge. (Fewer registrations, or more kept,
    take the fallback's bitmap instead: 64 bits per pending key or fewer.)"""
    rank = comm.Get_rank()
    count = _COUNT
    mgr = cgc.manager(comm)
    with GcDisabled():
        objs = [Tiny() for _ in range(600_000)]
        regs = [mgr.register(o, _count, (), {}, None) for o in objs]
        kept = {r.key: o for r, o in zip(regs[::60], objs[::60])}
        del regs, objs
        before = count[0]
        assert cgc.collect(comm, generation=None, timeout=60).destroyed == 590_000
        assert count[0] - before == 590_000
        if comm.Get_size() > 1:
            message = mgr.message
            assert message is not None and message[1] > max(kept), (
                "the kept keys must lie outside the window"
            )
        keys = np.array(sorted(kept), dtype=np.int64)
        dropped = _own_subset(rank, keys, 0.9).tolist()
        for k in dropped:
            del kept[k]
        before = count[0]
        stats = cgc.collect(comm, generation=None, timeout=60)
        common = set.intersection(*(set(d) for d in everyone(comm, dropped)))
        assert stats.destroyed == len(common) == count[0] - before
        assert mgr.broken is None
        kept.clear()
        cgc.collect(comm, generation=None, timeout=60)
    assert mgr.registered == 0


class SyncPointTests:
    """Sync points on one communicator: the key window and its fallback, participants'
    votes, snapshot, close, ``collect(obj)``. From the core v2 redesign (issue 14)."""

    COMM: MPI.Intracomm

    # -- the window and its fallback ----------------------------------------

    def test_keys_older_than_the_window_are_still_agreed(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        old = [Obj(i) for i in range(10)]
        for i, o in enumerate(old):
            cgc.register(o, log.destroy, ("old", i), comm=comm)
        # Many sync points with registrations move the window far past keys 0..9.
        for _ in range(12):
            batch = [Obj() for _ in range(300)]
            for o in batch:
                cgc.register(o, noop, comm=comm)
            del batch, o
            assert cgc.collect(comm, generation=None).destroyed == 300
        del old
        stats = cgc.collect(comm, generation=None)
        assert stats.destroyed == 10 and stats.pending == 0
        assert log.keys == [("old", i) for i in reversed(range(10))]

    def test_a_burst_larger_than_the_window_is_agreed_in_one_sync_point(
        self, comm: MPI.Intracomm
    ) -> None:
        cgc.collect(comm, generation=None)
        objs = [Obj() for _ in range(5000)]
        regs = [cgc.register(o, noop, comm=comm) for o in objs]
        del objs
        assert cgc.collect(comm, generation=None).destroyed == 5000
        assert not any(r.alive for r in regs)

    def test_old_keys_pending_on_some_ranks_only_stay_pending(self, comm: MPI.Intracomm) -> None:
        rank = comm.Get_rank()
        keep = [Obj(i) for i in range(20)]
        regs = [cgc.register(o, noop, comm=comm) for o in keep]
        for _ in range(10):
            batch = [Obj() for _ in range(200)]
            for o in batch:
                cgc.register(o, noop, comm=comm)
            del batch, o
            cgc.collect(comm, generation=None)
        # Every rank but the last drops the even ones; the last rank drops them
        # only after one more sync point: the other ranks hold them pending.
        last = comm.Get_size() - 1
        if rank != last or comm.Get_size() == 1:
            del keep[::2]
        cgc.collect(comm, generation=None)
        if comm.Get_size() > 1:
            assert all(r.alive for r in regs)
            if rank != last:
                assert [r.key for r in cgc.pending(comm)] == [r.key for r in regs[::2]]
            del keep[::2]
        cgc.collect(comm, generation=None)
        assert [r.alive for r in regs] == [i % 2 == 1 for i in range(20)]
        del keep
        assert cgc.collect(comm, generation=None).destroyed == 10

    # -- participants -----------------------------------------------------------

    def test_a_participant_votes_and_sees_the_or_on_every_rank(self, comm: MPI.Intracomm) -> None:
        seen: list[int] = []

        class Max(cgc.Participant):
            field = 3

            def vote(self, mgr: cgc.Manager) -> int:
                # a thermometer code of (rank % 4): the OR is the code of the max
                return (1 << (mgr.rank % 4)) - 1

            def finish(self, mgr: cgc.Manager, flags: int) -> None:
                seen.append(self.votes(flags))

        mgr = cgc.manager(comm)
        mgr.add_participant(Max())
        cgc.collect(comm, generation=None)
        top = (1 << min(comm.Get_size() - 1, 3)) - 1
        assert seen == [top]
        assert all(v == seen for v in comm.allgather(seen))

    def test_two_participants_in_one_field_are_refused(self, comm: MPI.Intracomm) -> None:
        class P(cgc.Participant):
            field = 4

        mgr = cgc.manager(comm)
        mgr.add_participant(P())
        with pytest.raises(cgc.CollectiveGCError, match="field 4"):
            mgr.add_participant(P())

    # -- snapshot and close ------------------------------------------------------

    def test_snapshot_changes_nothing(self, comm: MPI.Intracomm) -> None:
        with cgc.collective_scope(comm, strict=True, gc="off", exit_collect=None) as scope:
            a, b = Obj(), Obj()
            a.peer, b.peer = b, a
            reg = cgc.register(a, noop, comm=comm)
            alive = Obj()
            cgc.register(alive, noop, comm=comm)
            del a, b
            gc.collect()
            snap = cgc.manager(comm).snapshot()
            assert snap == cgc.manager(comm).snapshot()
            assert [r.key for r in snap.cyclic] == [reg.key]
            assert [r.key for r in snap.pending] == [reg.key]
            assert reg.key not in [r.key for r in snap.alive]
            assert snap.broken is None
            # The snapshot did not drain: strict mode still sees the cyclic death.
            with pytest.raises(cgc.CyclicFinalizationError):
                scope.sync()

    def test_close_runs_a_last_sync_point_then_refuses(self, comm: MPI.Intracomm) -> None:
        log = CheckedLog(comm)
        dead = Obj()
        cgc.register(dead, log.destroy, "dead", comm=comm)
        alive = Obj()
        reg = cgc.register(alive, log.destroy, "alive", comm=comm)
        del dead
        mgr = cgc.manager(comm)
        with pytest.warns(cgc.ExitLeakWarning, match="1 registration"):
            mgr.close()
        assert log.keys == ["dead"]
        assert reg.state == "detached"
        assert mgr not in cgc.managers()
        with pytest.raises(cgc.CollectiveGCError, match="closed"):
            cgc.register(Obj(), noop, comm=comm)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mgr.close()  # a second close does nothing

    # -- collect(obj) ------------------------------------------------------------------

    def test_collect_takes_an_object_with_a_comm(self, comm: MPI.Intracomm) -> None:
        class Mesh:
            def __init__(self, comm: MPI.Intracomm) -> None:
                self.comm = comm

        o = Obj()
        cgc.register(o, noop, comm=comm)
        del o
        assert cgc.collect(Mesh(comm), generation=None).destroyed == 1

        class Bad:
            comm = 3

        with pytest.raises(TypeError, match="not an mpi4py communicator"):
            cgc.collect(Bad())
        with pytest.raises(TypeError, match="or an object with a .comm"):
            cgc.collect(object())


class TestSyncPointSelf(SyncPointTests):
    COMM = MPI.COMM_SELF


@pytest.mark.mpi
class TestSyncPointWorld(SyncPointTests):
    COMM = MPI.COMM_WORLD


class Token:
    """What a destroy checks: the object it stands for must be dead by then."""

    __slots__ = ("ref", "key", "__weakref__")

    def __init__(self, obj: object) -> None:
        self.ref = weakref.ref(obj)
        self.key = -1


@pytest.fixture
def agreement_path() -> str:
    """Which way this process's agreements go: MPI-4's persistent allreduce
    (where mpi4py offers it), or a new Iallreduce each time where
    COLLECTIVE_GC_PERSISTENT=0 (make test's second 4-rank leg)."""
    return "persistent" if _agree.PERSISTENT else "iallreduce"  # (where MPI offers it)


def test_the_persistent_path_is_taken_where_mpi4py_offers_it(comm: MPI.Intracomm) -> None:
    """A family's agreement uses MPI-4's persistent allreduce exactly where
    mpi4py offers one that this MPI makes (and COLLECTIVE_GC_PERSISTENT is
    not 0), and the family agrees with other processes at all (a family of
    one process makes no collective: no request). Found by the hostile tests
    of core v2 (issue 14)."""
    offered = False
    init = getattr(comm, "Allreduce_init", None)
    if init is not None:
        buf = np.zeros(1, dtype=np.int64)
        try:
            req = init(MPI.IN_PLACE, buf, MPI.BAND)
        except NotImplementedError:
            pass
        else:
            offered = True
            req.Free()
    cgc.collect(comm, generation=None)
    fam = cgc_testing.family(comm)
    assert fam is not None
    assert fam.persistent == (offered and _agree.PERSISTENT and comm.Get_size() > 1)


@pytest.mark.parametrize("seed", [11, 23])
def test_random_drops_destroy_exactly_the_keys_dropped_everywhere(
    comm: MPI.Intracomm, seed: int, agreement_path: str
) -> None:
    """Bursts larger than the window, keys kept for many steps, keys dropped on
    some ranks only: each sync point must destroy exactly the keys every rank
    has dropped (no more: a live object; no fewer: a lost destroy), newest
    first, each once, and only once its object is dead here. The window's
    shape changes often, so a persistent request is remade often.

    Found by the hostile tests of core v2 (issue 14).
    """
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
    return (
        (key * 0x9E3779B97F4A7C15) % 2**64
    ) >> 58  # the filter bit the agreement sets (Fibonacci hashing)


@pytest.mark.mpi(min_size=2)
def test_colliding_filter_bits_destroy_nothing_not_pending_everywhere(
    comm: MPI.Intracomm,
) -> None:
    """Two old keys in the same filter bucket, each dropped on different ranks:
    the filter ANDs to nonzero, the fallback round runs, and must find nothing.

    Found by the hostile tests of core v2 (issue 14).
    """
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


def test_a_burst_beyond_the_window_limit_with_old_keys(comm: MPI.Intracomm) -> None:
    """More than WINDOW_LIMIT (2**20) keys dropped at once, plus keys older than
    any window, some dropped on one rank only.

    Found by the hostile tests of core v2 (issue 14).
    """
    rank = comm.Get_rank()
    n = _agree.WINDOW_LIMIT + 5000
    count = [0]

    def destroy() -> None:
        count[0] += 1

    with GcDisabled():
        old = [Tiny() for _ in range(100)]
        old_regs = [cgc.register(o, destroy, comm=comm) for o in old]
        cgc.collect(comm, generation=None, timeout=60)
        objs = [Tiny() for _ in range(n)]
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


def test_explicit_destroys_and_detaches_of_queued_old_keys(comm: MPI.Intracomm) -> None:
    """Old keys (outside the window) queued on some ranks only, then destroyed
    explicitly (collectively) or detached everywhere: never destroyed twice,
    never by a sync point afterwards.

    Found by the hostile tests of core v2 (issue 14).
    """
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
