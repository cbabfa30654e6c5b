"""Real collective resources in reference cycles, with per-rank GC timing."""

from __future__ import annotations

import gc
import random

import pytest
from mpi4py import MPI

import collective_gc as cgc

from _util import windows_or_skip


class WinHolder:
    """Holds an MPI window in a self-cycle, as a library's cache would."""

    def __init__(self, comm: MPI.Intracomm, freed: list[int], i: int) -> None:
        self.win = MPI.Win.Create(None, 1, MPI.INFO_NULL, comm)
        self.me = self  # only the cyclic collector can free this object
        self.payload = [0] * 50
        cgc.register(self, free_win, self.win, freed, i, comm=comm, name=f"win{i}")


def free_win(win: MPI.Win, freed: list[int], i: int) -> None:
    assert win != MPI.WIN_NULL, f"window {i} freed twice"
    win.Free()  # collective; nulls the handle, so a second free would be seen
    freed.append(i)


@pytest.mark.mpi(min_size=2)
def test_windows_in_cycles_with_per_rank_gc_timing(comm: MPI.Intracomm) -> None:
    windows_or_skip(comm)
    rank = comm.Get_rank()
    rng = random.Random(1000 + rank)
    old = gc.get_threshold()
    # Very different automatic-collection timing on each rank.
    gc.set_threshold(50 + 300 * rank, 3 + rank, 5)
    freed: list[int] = []
    noise: list[object] = []
    n = 300
    try:
        for step in range(n):
            WinHolder(comm, freed, step)
            noise.extend([{}] * rng.randrange(0, 400))  # per-rank allocation noise
            if len(noise) > 2000:
                noise.clear()
            if step % 10 == 9:
                cgc.collect(comm, generation=None)  # agree only: no forced collection
        stats = cgc.collect(comm)  # the final one collects everywhere
    finally:
        gc.set_threshold(*old)
    assert stats.pending == 0
    assert sorted(freed) == list(range(n)), "every window freed exactly once"
    # Every rank freed them in the same order.
    assert all(f == freed for f in comm.allgather(freed))
    mgr = cgc.manager(comm)
    assert mgr.destroyed == n and mgr.cyclic == n
