"""The last rank dies on an uncaught exception while the others still work.

Run without ``-m mpi4py``: the exiting rank's final agreement must give up at
its deadline instead of waiting for the others, and so must theirs.
"""

import time

from mpi4py import MPI

import collective_gc as cgc

comm = MPI.COMM_WORLD


class Res:
    pass


r = Res()
cgc.register(r, comm.Barrier, comm=comm)
del r
if comm.Get_rank() == comm.Get_size() - 1:
    raise RuntimeError("rank failed mid-loop")
time.sleep(4)  # longer than COLLECTIVE_GC_EXIT_TIMEOUT
cgc.collect(comm, timeout=2)
