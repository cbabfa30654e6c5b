"""The agreement: the key window and its fallback, its message, the persistent and the
Iallreduce paths, old keys pending on some ranks, the fallback intersection (issue 25,
defect 4 and "Scale").

The same file runs serially and on 4 ranks; the message-size test starts its
own jobs of 2, 4 and 16 ranks (marked ``launcher``, from the serial session).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

import collective_gc as cgc
from collective_gc import _agree

from _util import GcDisabled, Tiny, everyone
from conftest import mpiexec_cmd, mpiexec_env

JOBS = Path(__file__).parent / "jobs"


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
            window = mgr._agreement.window  # type: ignore[union-attr]
            assert window.lo > max(kept), "the kept keys must lie outside the window"
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
