"""Exit agreements run in the same order on every rank even when the ranks
looked their managers up in different orders (lookups are local)."""

from __future__ import annotations

import sys

from mpi4py import MPI

import collective_gc as cgc

world = MPI.COMM_WORLD
rank = world.Get_rank()
a, b = world.Dup(), world.Dup()
if rank == 0:
    print(repr(cgc.manager(b)))  # a local lookup of b before a, on rank 0 only


class Obj:
    pass


keep = [Obj(), Obj()]
sys.cgc_keep = keep  # type: ignore[attr-defined]
cgc.register(keep[0], print, f"destroyed a on rank {rank}", comm=a)
cgc.register(keep[1], print, f"destroyed b on rank {rank}", comm=b)
keep.clear()  # both queued: they must be agreed at exit, on both communicators
