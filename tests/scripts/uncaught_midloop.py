"""Rank 2 raises mid-loop while the others wait in sync points (run under -m mpi4py)."""

import sys
import time

from mpi4py import MPI

import collective_gc as cgc

comm = MPI.COMM_WORLD


class Res:
    pass


with open(sys.argv[1], "w") as f:
    f.write("started\n")
for step in range(1000):
    r = Res()
    cgc.register(r, comm.Barrier, comm=comm)
    del r
    if step == 5 and comm.Get_rank() == 2:
        raise RuntimeError("solver diverged on rank 2")
    cgc.collect(comm)
    time.sleep(0.01)
