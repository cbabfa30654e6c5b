"""A managed object whose destroy is collective, as a PETSc destroy would be."""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

import collective_gc as cgc


def release(comm: MPI.Intracomm, tag: str) -> None:
    # Collective, and a check that every rank releases the same object here.
    tags = comm.allgather(tag)
    if len(set(tags)) != 1:
        raise RuntimeError(f"ranks released different objects together: {tags}")


class Solver:
    """Owns nothing real; its registration stands for a collective resource."""

    def __init__(self, comm: MPI.Intracomm, tag: str) -> None:
        self.me: Any = self  # in a reference cycle, as real codes leave them
        self.reg = cgc.register(self, release, comm, tag, comm=comm, name=tag)
