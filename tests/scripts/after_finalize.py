"""Objects finalized after MPI is finalized: their finalizers must do nothing."""

import gc

from mpi4py import MPI

import collective_gc as cgc

comm = MPI.COMM_WORLD


class Res:
    pass


keep = []
for _ in range(10):
    r = Res()
    r.me = r  # only the collector frees it: after MPI_Finalize below
    cgc.register(r, comm.Barrier, comm=comm)
    keep.append(r)
cgc.collect(comm)
MPI.Finalize()
keep.clear()
gc.collect()  # finalizers run now, with MPI finalized: they only queue
try:
    cgc.collect(comm)
except cgc.CollectiveGCError as exc:
    assert "finalized" in str(exc), exc
else:
    raise AssertionError("collect after MPI_Finalize did not raise")
print("ok")
