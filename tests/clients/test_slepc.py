"""SLEPc as a real client (issue 33): run by ``make test-clients`` on 4 ranks,
with Debian 12's python3-slepc4py 3.18 and Debian 13's 3.22 (installed by the
Makefile's test-clients-LEG; both import without SLEPC_DIR)."""

from __future__ import annotations

import gc
import os
import sys
import weakref
from typing import Any

import pytest
from mpi4py import MPI

from conftest import import_client

# make test-clients sets CGC_REQUIRE_SLEPC=1: there a missing slepc4py fails
# the run instead of skipping it.
SLEPc = import_client("slepc4py.SLEPc", "CGC_REQUIRE_SLEPC")
from petsc4py import PETSc  # noqa: E402

import collective_gc as cgc  # noqa: E402
from collective_gc import petsc as cp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from slepc_loop import Step, exact, petsc_log_alive  # noqa: E402

WORLD = MPI.COMM_WORLD


@pytest.mark.mpi(min_size=2)
def test_each_steps_objects_are_gone_at_the_next_sync_point() -> None:
    """The documented path of docs/guides/slepc.rst: an EPS with
    shift-and-invert (its ST, KSP, PC and MUMPS factor inside) per step,
    managed on COMM_WORLD. After each step's sync point nothing of it is
    registered or pending, no PETSc garbage is left, and PETSc's own log
    shows every PETSc and SLEPc object the step created destroyed, on every
    rank; the eigenvalues are right. Rank 0 collects alone first: nothing is
    destroyed there before the sync point."""
    gc.collect()
    PETSc.garbage_cleanup()
    PETSc.Log.begin()
    before = petsc_log_alive()
    with cgc.collective_scope(WORLD, timeout=120) as scope:
        base = cgc.manager(WORLD).registered
        for i in range(6):
            step = Step(100)
            cp.manage(step, step.A, step.xr, step.xi, step.eps, comm=WORLD)
            got = step.solve()
            assert max(abs(a - b) for a, b in zip(got, exact(100))) < 1e-8, got
            del step
            if WORLD.rank == 0:
                gc.collect()  # one rank alone: destroys are only queued
                assert petsc_log_alive() != before
            gc.collect(0)
            scope.sync()
            assert cgc.manager(WORLD).registered == base, f"step {i}"
            assert cp.garbage(WORLD) == []
            alive = petsc_log_alive()
            assert alive == before, f"rank {WORLD.rank}, step {i}: PETSc's log: {alive}"


class Monitored(Step):
    """A step whose EPS monitor is a bound method of the step, or (weak=True)
    a function that reaches the method through a weak reference."""

    def __init__(self, n: int, weak: bool) -> None:
        super().__init__(n)
        self.calls = 0
        if weak:
            method = weakref.WeakMethod(self.monitor)

            def monitor(*args: Any) -> None:
                bound = method()
                if bound is not None:
                    bound(*args)

            self.eps.setMonitor(monitor)
        else:
            self.eps.setMonitor(self.monitor)

    def monitor(self, *args: Any) -> None:
        self.calls += 1


@pytest.mark.mpi(min_size=2)
def test_a_monitor_that_is_a_method_of_the_owner_is_refused() -> None:
    """Issue 33: an EPS whose monitor is a bound method of the step would
    keep the step alive for ever once the registration holds the EPS; manage
    refuses it at once, on every rank, naming the path back to the step (as
    docs/petsc.md says). With a monitor that reaches the step through a weak
    reference, the step dies and every object it made is destroyed."""
    step = Monitored(50, weak=False)
    with pytest.raises(cgc.RegistrationError, match="Monitored"):
        cp.manage(step, step.A, step.xr, step.xi, step.eps, comm=WORLD)
    step.eps.cancelMonitor()
    for obj in (step.eps, step.A, step.xr, step.xi):
        obj.destroy()
    del step
    gc.collect()
    PETSc.garbage_cleanup()
    PETSc.Log.begin()
    before = petsc_log_alive()
    with cgc.collective_scope(WORLD, timeout=120) as scope:
        step = Monitored(50, weak=True)
        cp.manage(step, step.A, step.xr, step.xi, step.eps, comm=WORLD)
        step.solve()
        assert step.calls > 0
        del step
        gc.collect(0)
        scope.sync()
    alive = petsc_log_alive()
    assert alive == before, f"rank {WORLD.rank}: PETSc's log: {alive}"
