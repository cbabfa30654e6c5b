"""A destroy failed at the program's last sync point (the failure is kept
for the family's next agreement); another object is dropped afterwards. The
exit agreement's first sync point reports the failure (an ExitLeakWarning
naming both sync points) and destroys nothing; the next one must still
destroy what was dropped, on every rank."""

from __future__ import annotations

from mpi4py import MPI

import collective_gc as cgc

world = MPI.COMM_WORLD
rank = world.Get_rank()
comm = world.Dup()


class Obj:
    pass


def bad() -> None:
    raise RuntimeError("fails at the last sync point")


o = Obj()
cgc.register(o, bad, comm=comm, name="bad")
del o
cgc.collect(comm)  # runs it: the failure is kept, nothing raised yet
o = Obj()
cgc.register(o, print, f"destroyed late on rank {rank}", comm=comm, name="late")
del o
print(f"exiting on rank {rank}", flush=True)
