"""Rank 0 runs one sync point more than the others, which go on to exit: the
extra sync point must not match their exit agreement (issue 11, defect 5)."""

from __future__ import annotations

from mpi4py import MPI

import collective_gc as cgc

world = MPI.COMM_WORLD
comm = world.Dup()


class Obj:
    pass


objs = [Obj() for _ in range(3)]
for i, o in enumerate(objs):
    cgc.register(o, print, f"destroyed {i} on rank {world.Get_rank()}", comm=comm)
del o
del objs
cgc.collect(comm)
if world.Get_rank() == 0:
    try:
        cgc.collect(comm)  # one more than the others
        print("extra sync point on rank 0: OK")
    except cgc.CollectiveMismatchError as exc:
        print(f"extra sync point on rank 0: MISMATCH: {exc}")
