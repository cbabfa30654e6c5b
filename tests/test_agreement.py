"""The agreement: its message, its deadlines, participants' fingerprint, the
fallback intersection (issue 25, defects 4, 5, 6 and "Scale").

The same file runs serially and on 4 ranks; the message-size test starts its
own jobs of 2, 4 and 16 ranks (marked ``launcher``, from the serial session).
"""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import collective_gc as cgc
from collective_gc import _agree, _manager

from _util import GcDisabled
from conftest import mpiexec_cmd, mpiexec_env

JOBS = Path(__file__).parent / "jobs"


def everyone(comm: MPI.Comm, value: Any) -> list[Any]:
    """Every rank's ``value`` (over the test's own communicator, not the manager's)."""
    return comm.allgather(value) if comm.Get_size() > 1 else [value]


class Obj:
    pass


def noop() -> None:
    pass


# -- clocks (defect 5) ---------------------------------------------------------------


def test_no_decision_reads_the_wall_clock() -> None:
    """Deadlines are this rank's own ``time.monotonic()``; nothing of the
    agreement or of a sync point reads ``time.time()``, which differs between
    nodes."""
    for module in (_agree, _manager):
        assert "time.time(" not in inspect.getsource(module), module.__name__


@pytest.mark.mpi(min_size=2)
def test_a_rank_whose_clock_is_ahead_times_nothing_out(
    comm: MPI.Intracomm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25, defect 5: with rank 0's wall clock 3 s ahead of the others'
    (as on a node whose NTP is off) and ``timeout=2``, the first sync point
    raised CollectiveTimeoutError on rank 0 ("completed only after the
    deadline of another rank") though nobody waited more than milliseconds."""
    if comm.Get_rank() == 0:
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 3.0)
    keep = []
    for step in range(5):
        objs = [Obj() for _ in range(50)]
        for o in objs:
            cgc.register(o, noop, comm=comm)
        keep.append(objs.pop())
        del objs, o
        stats = cgc.collect(comm, generation=None, timeout=2)
        assert stats.destroyed == 49, (step, stats)
    assert cgc.manager(comm).broken is None
    keep.clear()
    assert cgc.collect(comm, generation=None, timeout=2).destroyed == 5


@pytest.mark.mpi(min_size=3)
def test_a_rank_that_gives_up_wakes_the_ranks_waiting_without_a_deadline(
    comm: MPI.Intracomm,
) -> None:
    """Rank 0 gives up on a sync point (``timeout=0.5``) for which rank 1 is 3 s
    late; ranks 2.. wait there without a deadline. They must hear of it at
    once (CollectiveTimeoutError naming rank 0 and the sync point), not wait
    for rank 1; rank 1, arriving after rank 0 gave up, raises too."""
    rank = comm.Get_rank()
    cgc.collect(comm, generation=None)  # the private duplicate exists everywhere
    if rank == 1:
        time.sleep(3.0)
    t0 = time.monotonic()
    outcome = "OK"
    message = ""
    try:
        cgc.collect(comm, generation=None, timeout=0.5 if rank == 0 else None)
    except cgc.CollectiveTimeoutError as exc:
        outcome, message = "TIMEOUT", str(exc)
    elapsed = time.monotonic() - t0
    states = everyone(comm, (outcome, elapsed, message, cgc.manager(comm).broken is not None))
    assert [s[0] for s in states] == ["TIMEOUT"] * len(states), states
    assert all(s[3] for s in states), "a manager stayed usable after a timeout"
    assert states[0][1] < 2.0, states[0]
    for r, (_, took, text, _) in enumerate(states):
        if r >= 2:
            assert took < 2.0, f"rank {r} waited {took:.1f} s for the late rank"
        if r >= 1:
            assert re.search(r"rank 0 gave up .*sync point 1\b", text), (r, text)


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_leaves_by_an_exception_wakes_the_others(comm: MPI.Intracomm) -> None:
    """Rank 1 leaves a sync point's wait by a second Ctrl-C (the first is held
    until the region's end, the second runs at once) while the others are
    still on their way. They must hear of it at once, naming rank 1, instead
    of waiting for it at their next collective (before: for ever, or until
    their own timeout, 20 s here)."""
    rank = comm.Get_rank()
    cgc.collect(comm, generation=None)  # the private duplicate exists everywhere
    comm.Barrier()
    outcome, message, took = "OK", "", 0.0
    if rank == 1:
        timers = [threading.Timer(t, os.kill, (os.getpid(), signal.SIGINT)) for t in (0.3, 0.6)]
        for t in timers:
            t.start()
        try:
            cgc.collect(comm, generation=None, timeout=30)
        except KeyboardInterrupt:
            outcome = "INTERRUPTED"
        finally:
            for t in timers:
                t.join()
    else:
        time.sleep(1.5)
        t0 = time.monotonic()
        try:
            for _ in range(2):  # this one may complete: rank 1 had sent its part
                cgc.collect(comm, generation=None, timeout=20)
        except cgc.CollectiveTimeoutError as exc:
            outcome, message = "TIMEOUT", str(exc)
        took = time.monotonic() - t0
    states = everyone(comm, (outcome, took, message, cgc.manager(comm).broken is not None))
    assert states[1][0] == "INTERRUPTED" and states[1][3], states[1]
    for r, (got, took, text, broken) in enumerate(states):
        if r != 1:
            assert got == "TIMEOUT" and broken, (r, got, text)
            assert took < 5.0, f"rank {r} waited {took:.1f} s for the rank that left"
            assert re.search(
                r"rank 1 left the collectives by an exception at sync point 1\b", text
            ), (
                r,
                text,
            )


# -- the message: independent of the number of ranks (Scale) -----------------------------


def test_the_message_layout_is_independent_of_the_number_of_ranks() -> None:
    """At most 16 words beyond the key window, whatever the communicator."""
    for bits in (_agree.Window.MIN, 4096, _agree.Window.LIMIT):
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
    assert empty == _agree.message_words(_agree.Window.MIN), seen


# -- participants' fingerprint (defect 6) ---------------------------------------------


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


def test_the_participants_fingerprint_has_64_bits() -> None:
    values = {_agree.fingerprint(f"p{i}") for i in range(20_000)}
    assert len(values) == 20_000
    assert any(v >= 1 << 48 or v < 0 for v in values)  # all 64 bits are used
    assert all(-(1 << 63) <= v < 1 << 63 for v in values)  # one int64 word


# -- the fallback intersection (defect 4) ---------------------------------------------


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
    got = _agree.intersect_any(comm, mine, _agree.Deadline(time.monotonic() + 60), lambda: "")
    want = set(mine.tolist())
    for r in range(size):
        want &= set(_holding(r, all_keys, keep).tolist())
    assert got.dtype == np.int64
    assert got.tolist() == sorted(want)
    assert everyone(comm, got.tolist()) == [got.tolist()] * size


class _Tiny:
    __slots__ = ("__weakref__",)


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
        objs = [_Tiny() for _ in range(600_000)]
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
