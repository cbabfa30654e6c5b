"""Only the last rank reaches the first sync point of a communicator, so its
private duplicate (MPI_Comm_idup) is abandoned at the deadline; the program
then frees seven other communicators and this one, and ends normally. The job must exit cleanly:
on Open MPI 4 an Idup that never completes left MPI_Finalize releasing the
freed communicator a second time (an abort in about half the runs; seven
freed communicators of the same size beforehand make it happen every time,
as they fill glibc's cache of freed blocks of that size)."""

from mpi4py import MPI

import collective_gc as cgc

world = MPI.COMM_WORLD
last = world.Get_rank() == world.Get_size() - 1
comm = world.Dup()
extra = [world.Dup() for _ in range(7)]
if last:
    try:
        cgc.collect(comm, timeout=0.3)
    except cgc.CollectiveTimeoutError:
        print("gave-up", flush=True)
world.Barrier()
for c in extra:
    c.Free()
comm.Free()
print("finished", world.Get_rank(), flush=True)
