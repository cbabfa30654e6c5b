"""Tests that pass with collective_gc's leak check on, under mpi-pytest."""

from __future__ import annotations

import os

import pytest
from _resources import Solver
from mpi4py import MPI
from pytest_mpi import parallel_assert as mpi_pytest_assert

import collective_gc as cgc
from collective_gc.pytest_plugin import parallel_assert


@pytest.mark.parallel(nprocs=4)
def test_solvers_in_cycles() -> None:
    comm = MPI.COMM_WORLD
    for step in range(3):
        Solver(comm, f"step-{step}")  # each in a cycle: found by the final sync
    sub = cgc.split(comm, comm.Get_rank() % 2)
    Solver(sub, f"half-{comm.Get_rank() % 2}")
    del sub
    parallel_assert(comm.Get_size() == 4, "mpi-pytest gave the wrong size")


@pytest.mark.parallel(nprocs=4)
def test_both_parallel_asserts() -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    mpi_pytest_assert(rank >= 0)
    parallel_assert(lambda: rank < 4, lambda: f"rank {rank} out of range")


def test_serial_on_self() -> None:
    # mpi-pytest's serial test (marked parallel[1]): run by the forking
    # parent, deselected by `-m parallel[4]`.
    Solver(MPI.COMM_SELF, "serial")


@pytest.mark.parallel(nprocs=4)
def test_command_line_exported_for_forked_children(request: pytest.FixtureRequest) -> None:
    # mpi-pytest's forked children see the environment, not the command line:
    # a --cgc-leak-check given here is handed on through it.
    if request.config.getoption("cgc_leak_check"):
        parallel_assert(os.environ.get("COLLECTIVE_GC_LEAK_CHECK") == "1", "not exported")
