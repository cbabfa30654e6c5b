"""One leak the check must report, and a test after it that must pass."""

from __future__ import annotations

import pytest
from _resources import Solver
from mpi4py import MPI

_KEEP: list[object] = []


@pytest.mark.parallel(nprocs=4)
def test_leaks_a_solver() -> None:
    _KEEP.append(Solver(MPI.COMM_WORLD, "leaky-solver"))  # kept in a global


@pytest.mark.parallel(nprocs=4)
def test_after_the_leak() -> None:
    Solver(MPI.COMM_WORLD, "dropped")
