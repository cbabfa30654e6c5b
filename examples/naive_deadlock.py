"""The solver loop of examples/solver_loop.py without collective_gc: it hangs.

The same wrappers in the same reference cycles, but each releases what it
owns in ``__del__``, as dolfinx's docs warn against and as users write
anyway. With a different GC threshold and allocation on each rank, Python's
cyclic collector runs ``__del__`` at a different moment on each rank: one rank
frees a window (``MPI_Win_free`` synchronizes the window's group) while another
is inside a solve's allreduce, or freeing a different window. No rank can go
on; the job hangs, usually within the first steps.

So that it ends by itself, a watchdog (``faulthandler``, which runs in a C
thread and needs no GIL, so it fires even with every rank stuck inside MPI)
prints where each rank is stuck after ``--hang-after`` seconds (default 20)
and ends the process with status 1. If a run is lucky enough to finish, it
says so and exits 0.

Run: mpiexec -n 4 python examples/naive_deadlock.py [steps]     (make demo-naive)
"""

from __future__ import annotations

import faulthandler
import gc
import random
import sys
import time
from typing import Any

import numpy as np
from mpi4py import MPI
from petsc4py import PETSc

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 200
HANG_AFTER = 20.0
for i, arg in enumerate(sys.argv):
    if arg == "--hang-after" and i + 1 < len(sys.argv):
        HANG_AFTER = float(sys.argv[i + 1])
GRID = 48


def laplacian(m: int) -> PETSc.Mat:
    n = m * m
    A = PETSc.Mat().createAIJ([n, n], nnz=(5, 4), comm=comm)
    lo, hi = A.getOwnershipRange()
    for row in range(lo, hi):
        i, j = divmod(row, m)
        A.setValue(row, row, 4.0)
        for di, dj in ((-1, 0), (1, 0), (0, -1), (0, 1)):
            if 0 <= i + di < m and 0 <= j + dj < m:
                A.setValue(row, (i + di) * m + j + dj, -1.0)
    A.assemble()
    return A


class SolverCache:
    def __init__(self, problem: Problem, A: PETSc.Mat) -> None:
        self.problem = problem
        self.ksp = PETSc.KSP().create(comm)
        self.ksp.setOperators(A)
        self.ksp.setType("cg")
        self.ksp.getPC().setType("jacobi")
        self.x, self.b = A.createVecs()

    def solve(self, scale: float) -> int:
        self.b.set(scale)
        self.ksp.solve(self.b, self.x)
        return int(self.ksp.getIterationNumber())

    def __del__(self) -> None:  # the hazard: collective destroys at a GC-chosen moment
        self.ksp.destroy()
        self.x.destroy()
        self.b.destroy()


class Accumulator:
    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.buf = np.zeros(1)
        self.win = MPI.Win.Create(self.buf, self.buf.itemsize, MPI.INFO_NULL, comm)

    def total(self, value: float) -> float:
        self.win.Fence()
        self.win.Accumulate(np.array([value]), 0, op=MPI.SUM)
        self.win.Fence()
        return float(comm.bcast(self.buf[0], root=0))

    def __del__(self) -> None:  # MPI_Win_free synchronizes every rank of comm
        self.win.Free()


class Problem:
    def __init__(self, A: PETSc.Mat) -> None:
        self.cache = SolverCache(self, A)
        self.acc = Accumulator(self)


def say(text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def main() -> None:
    say(
        f"naive solver loop: {size} ranks, {STEPS} steps, collective destroys in __del__. "
        f"Expected to hang; a watchdog ends it after {HANG_AFTER:.0f} s."
    )
    faulthandler.dump_traceback_later(HANG_AFTER, exit=True)
    rng = random.Random(rank)
    gc.set_threshold(200 + 400 * rank, 5 + 2 * rank, 10)
    noise: list[Any] = []
    A = laplacian(GRID)
    t0 = time.perf_counter()
    for step in range(STEPS):
        problem = Problem(A)
        its = problem.cache.solve(1.0 + step % 7)
        problem.acc.total(float(its))
        for _ in range(rng.randrange(50, 400)):
            cell: list[Any] = []
            cell.append(cell)
            noise.append(cell)
        if len(noise) > 3000:
            noise.clear()
        if (step + 1) % 20 == 0:
            say(f"  step {step + 1:4d} ({time.perf_counter() - t0:.1f} s)")
    faulthandler.cancel_dump_traceback_later()
    say(
        "finished without hanging this time (lucky: the collectors happened to run in "
        "step on every rank); run it again, or with more ranks"
    )


if __name__ == "__main__":
    main()
