"""4 ranks drop managed objects (some in cycles) and exit without a sync point.

Each destroy makes a collective call, so it can only complete if every rank
runs it at exit, in the same order. Writes one line per destroy to
``<argv[1]>/rank<r>.txt``.
"""

import gc
import sys

from mpi4py import MPI

import collective_gc as cgc

comm = MPI.COMM_WORLD
gc.disable()


class Res:
    pass


out = open(f"{sys.argv[1]}/rank{comm.Get_rank()}.txt", "w")


def destroy(i: int) -> None:
    total = comm.allreduce(i)
    assert total == i * comm.Get_size(), (total, i)
    out.write(f"{i}\n")
    out.flush()


keep = []
for i in range(20):
    r = Res()
    cgc.register(r, destroy, i, comm=comm)
    if i % 2:
        r.self = r  # a cycle: only the collector can free it
    if i == 19:
        keep.append(r)  # alive at exit on every rank: not destroyed
del r
