"""A scope's back-off: sync calls that agree only every N calls or every T seconds."""

from __future__ import annotations

import time

import pytest
from mpi4py import MPI

import collective_gc as cgc

from _util import Obj, everyone, same_on_all


def _ran(stats: cgc.CollectStats) -> bool:
    return stats.sync != -1


def test_the_back_off_options_are_checked() -> None:
    comm = MPI.COMM_SELF
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every"):
            cgc.collective_scope(comm, every=bad)
    for bad_s in (0, -1.0, float("inf"), "1"):
        with pytest.raises(ValueError, match="seconds"):
            cgc.collective_scope(comm, seconds=bad_s)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not both"):
        cgc.collective_scope(comm, every=2, seconds=1.0)
    for strict in (True, "warn"):
        with pytest.raises(ValueError, match="strict"):
            cgc.collective_scope(comm, strict=strict, every=2)  # type: ignore[arg-type]


@pytest.mark.mpi(min_size=2)
def test_every_n_agrees_at_the_same_calls_everywhere_and_loses_nothing(
    comm: MPI.Intracomm,
) -> None:
    """every=5: calls 0, 5, 10, ... are sync points, the others return at
    once; an object dropped between is destroyed at the next one; one
    dropped after the last is destroyed by the scope's exit (never skipped)."""
    log: list[int] = []
    ran = []
    destroyed_at: dict[int, int] = {}
    with cgc.collective_scope(comm, every=5) as scope:
        for i in range(23):
            o = Obj()
            cgc.register(o, log.append, i, comm=comm)
            del o
            before = len(log)
            stats = scope.sync()
            ran.append(_ran(stats))
            for key in log[before:]:
                destroyed_at[key] = i
        assert scope.skipped == 23 - 5
    assert ran == [i % 5 == 0 for i in range(23)], ran
    assert sorted(log) == list(range(23))  # each destroyed once, the last ones at exit
    # Dropped at call i, destroyed at the first sync point from i on (or exit).
    for key, at in destroyed_at.items():
        assert at >= key and at - key < 5 and at % 5 == 0, (key, at)
    assert set(destroyed_at) == set(range(21))
    assert same_on_all(comm, (ran, destroyed_at))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_seconds_decides_alike_on_every_rank_under_uneven_loads(comm: MPI.Intracomm) -> None:
    """seconds=: each rank measures its own pace (rank r works r times
    longer per call than rank 0, and rank 1 starts late), only durations of
    its own clock are read, and the agreement carries how many calls to let
    pass: every rank lets pass the same calls. The numbers are a power of 4
    less one, and objects die and are destroyed during the loop, not only at
    its exit."""
    rank = comm.Get_rank()
    if rank == 1:
        time.sleep(0.05)  # a late rank: its first interval is longer
    log: list[int] = []
    ran = []
    with cgc.collective_scope(comm, seconds=0.02) as scope:
        for i in range(300):
            time.sleep(0.0001 * (1 + rank))  # uneven work per call
            if i % 7 == 0:
                o = Obj()
                cgc.register(o, log.append, i, comm=comm)
                del o
            ran.append(_ran(scope.sync()))
        in_loop = len(log)
    everyone_ran = everyone(comm, ran)
    assert all(r == ran for r in everyone_ran), "the ranks agreed at different calls"
    agreed_at = [i for i, r in enumerate(ran) if r]
    assert agreed_at[0] == 0 and len(agreed_at) > 2, agreed_at
    gaps = {b - a for a, b in zip(agreed_at, agreed_at[1:])}
    assert gaps <= {1, 4, 16, 64, 256, 1024}, gaps
    assert max(gaps) >= 4, gaps  # ~20 ms hold ~50 calls of the slowest rank: some let pass
    assert sorted(log) == list(range(0, 300, 7))
    assert in_loop > 0


@pytest.mark.mpi(min_size=2)
def test_a_skipped_call_costs_no_collective_and_the_exit_is_not_skipped(
    comm: MPI.Intracomm,
) -> None:
    """Between agreements the scope makes no MPI call: a rank may reach its
    let-pass calls while the others are busy elsewhere (here rank 0 runs
    them all before the others start), and nothing waits. The exit sync
    point runs whatever the back-off says."""
    log: list[str] = []
    with cgc.collective_scope(comm, every=1000) as scope:
        assert _ran(scope.sync())
        if comm.Get_rank() == 0:
            for _ in range(999):
                assert not _ran(scope.sync())
            comm.Barrier()
        else:
            comm.Barrier()
            for _ in range(999):
                assert not _ran(scope.sync())
        o = Obj()
        cgc.register(o, log.append, "dropped last", comm=comm)
        del o
    assert log == ["dropped last"]
