"""A managed resource for the sample suite, whose destroy is itself collective."""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

import collective_gc as cgc


def release(comm: MPI.Intracomm, tag: str) -> None:
    # A collective destroy, as a real one (PETSc, MPI_Win_free) would be; it
    # also checks that every rank releases the same resource at this point.
    tags = comm.allgather(tag)
    if len(set(tags)) != 1:
        raise RuntimeError(f"ranks released different resources together: {tags}")


class Resource:
    """Owns nothing real; its registration stands for a collective resource."""

    def __init__(self, comm: MPI.Intracomm, tag: str) -> None:
        self.peer: Any = None
        self.reg = cgc.register(self, release, comm, tag, comm=comm, name=tag)
