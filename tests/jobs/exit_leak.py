"""A destroy pending on some ranks only at exit is named in an ExitLeakWarning
on the ranks that had it (issue 11, defect 13); the rest is destroyed."""

from __future__ import annotations

import sys

from mpi4py import MPI

import collective_gc as cgc

world = MPI.COMM_WORLD
rank = world.Get_rank()
comm = world.Dup()


class Obj:
    pass


keep = {name: Obj() for name in ("everywhere", "only-on-rank-0")}
sys.cgc_keep = keep  # type: ignore[attr-defined]  # alive until exit, past the script
for name, o in keep.items():
    cgc.register(o, print, f"destroyed {name} on rank {rank}", comm=comm, name=name)
del o
del keep["everywhere"]
if rank == 0:
    del keep["only-on-rank-0"]
