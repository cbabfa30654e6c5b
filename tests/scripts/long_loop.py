"""A loop that runs until killed; writes a marker once every rank is in it."""

import sys
import time

from mpi4py import MPI

import collective_gc as cgc

comm = MPI.COMM_WORLD


class Res:
    pass


with cgc.collective_scope(comm) as scope:
    for step in range(100000):
        r = Res()
        r.me = r
        cgc.register(r, comm.Barrier, comm=comm)
        del r
        scope.sync()
        if step == 3:
            comm.Barrier()
            if comm.Get_rank() == 0:
                with open(sys.argv[1], "w") as f:
                    f.write("looping\n")
        time.sleep(0.005)
