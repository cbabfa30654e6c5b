"""A user's script under mpiexec: mpi4py imported at the top, a loader per rank.

Workers re-import this file (as __mp_main__) to find ``probe``; they must not
initialize MPI, join the job, or bring it down. Prints one line per rank.
"""

from __future__ import annotations

import os
import sys

from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from collective_gc.data import ProcessPrefetch, shard_indices  # noqa: E402


def probe(i: int) -> tuple[int, bool, int]:
    return i, MPI.Is_initialized(), os.getppid()


if __name__ == "__main__":
    comm = MPI.COMM_WORLD
    mine = shard_indices(40, comm)
    with ProcessPrefetch(probe, mine, num_workers=2) as loader:
        got = list(loader)
    assert [g[0] for g in got] == list(mine), got
    assert not any(g[1] for g in got), "a worker initialized MPI"
    assert all(g[2] == os.getpid() for g in got)
    total = comm.allreduce(len(got))
    print(f"rank {comm.Get_rank()} of {comm.Get_size()}: {len(got)} elements, total {total}")
