"""After a hand-called MPI.Finalize, every collective_gc call that would need MPI
raises CollectiveGCError, on a user communicator too (issue 11, defect 6), and
what was left pending is named at exit (defect 13)."""

from __future__ import annotations

import sys

from mpi4py import MPI

import collective_gc as cgc

world = MPI.COMM_WORLD
rank = world.Get_rank()
comm = world.Dup()


class Obj:
    pass


keep = [Obj() for _ in range(2)]
sys.cgc_keep = keep  # type: ignore[attr-defined]  # alive until exit, past the script
for i, o in enumerate(keep):
    cgc.register(o, print, i, comm=comm, name=f"res{i}")
del o
cgc.collect(comm)
if rank == 0:
    keep.pop()  # res1 dies on rank 0 only: queued, never agreed
MPI.Finalize()
for what, call in [
    ("collect", lambda: cgc.collect(comm)),
    ("register", lambda: cgc.register(Obj(), print, comm=comm)),
]:
    try:
        call()
        print(f"{what} after finalize on rank {rank}: no error")
    except cgc.CollectiveGCError as exc:
        print(f"{what} after finalize on rank {rank}: CollectiveGCError: {exc}")
