"""A solver loop as a finite-element code writes it, with collective_gc deciding when
anything collective is destroyed.

A parallel MPIAIJ matrix (the 5-point Laplacian on a square grid) is assembled
once. Then each of 200 steps builds, inside wrapper classes that sit in
reference cycles (as a library's caches do):

- a ``SolverCache``: a KSP with its work vectors, whose ``solve`` is a sync point;
- a ``GroupExchange``: a sub-communicator (``cgc.split``: the ranks in two
  groups), a PETSc Vec on it and an MPI window on it for one-sided sums;
- raw temporaries that Python simply drops (PETSc's own garbage).

Every rank uses a different GC threshold and allocates a different amount of
cyclic noise, so Python would finalize these objects at different moments on
each rank. Freeing a window synchronizes the group, so destroying in
``__del__`` hangs (run ``examples/naive_deadlock.py``). Here the finalizers only
queue; the sync point after each solve agrees across the ranks on what every
rank has dropped, destroys it in one order, frees the sub-communicators once
empty, and cleans PETSc's garbage; ``gc="managed"`` makes the cyclic
collections themselves happen at the same sync point on every rank.

Run: mpiexec -n 4 python examples/solver_loop.py [steps]      (make demo)
"""

from __future__ import annotations

import gc
import random
import sys
import time
import weakref
from typing import Any

import numpy as np
from mpi4py import MPI
from petsc4py import PETSc

import collective_gc as cgc
from collective_gc import mpi as cmpi
from collective_gc import petsc as cp

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 200
GRID = 48  # unknowns: GRID * GRID

# What the summary counts, on this rank.
registrations: list[cgc.Registration] = []
WAITED = [0.0]  # seconds at the barrier before each sync point (see SolverCache.solve)
COLLECTOR = [0.0, 0.0]  # seconds in Python's cyclic collector; when the running one began


def time_collector(phase: str, info: dict[str, int]) -> None:
    # A gc callback: it only reads the clock (no MPI in a GC callback).
    if phase == "start":
        COLLECTOR[1] = time.perf_counter()
    else:
        COLLECTOR[0] += time.perf_counter() - COLLECTOR[1]


# PETSc's own count of live objects: a serial Vec composed onto every object
# we create; PETSc holds one reference to it per live holder.
tracker = PETSc.Vec().createSeq(1, comm=PETSc.COMM_SELF)


def track(*objs: Any) -> None:
    for obj in objs:
        obj.compose("solver-loop-tracker", tracker)


def laplacian(m: int) -> PETSc.Mat:
    """Collective: the 5-point Laplacian on an m x m grid, rows split over the ranks."""
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


class Operator:
    """Owns the matrix for the whole loop."""

    def __init__(self) -> None:
        self.A = laplacian(GRID)
        registrations.append(cp.manage(self, self.A, comm=comm, name="Operator"))


class SolverCache:
    """A KSP and its work vectors; refers back to its problem (a cycle)."""

    def __init__(self, problem: Problem, A: PETSc.Mat) -> None:
        self.problem = problem
        self.ksp = PETSc.KSP().create(comm)
        self.ksp.setOperators(A)
        self.ksp.setType("cg")
        self.ksp.getPC().setType("jacobi")
        self.ksp.setTolerances(rtol=1e-8)
        # A weak proxy, never self: the registration holds the KSP until this
        # cache dies, so a KSP holding the cache would keep it alive for ever
        # (cp.immortal and cgc.view name such owners).
        self.ksp.setAppCtx(weakref.proxy(self))
        self.x, self.b = A.createVecs()
        track(self.ksp, self.x, self.b)
        registrations.append(
            cp.manage(self, self.ksp, self.x, self.b, comm=comm, name="SolverCache")
        )

    @cgc.sync_point  # after each solve: a sync point of the open collective_scope
    def solve(self, scale: float) -> int:
        self.b.set(scale)
        self.ksp.solve(self.b, self.x)
        # The wait for the slowest rank, timed apart: without this barrier
        # the sync point's collective would absorb it (the ranks' per-step
        # noise below differs), and the sync point would look dearer than it is.
        w0 = time.perf_counter()
        comm.Barrier()
        WAITED[0] += time.perf_counter() - w0
        return int(self.ksp.getIterationNumber())


class Accumulator:
    """A one-sided window for sums at rank 0; refers back to its problem (a cycle)."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.buf = np.zeros(1)
        self.win = MPI.Win.Create(self.buf, self.buf.itemsize, MPI.INFO_NULL, comm)
        registrations.append(cmpi.manage(self, self.win, comm=comm, name="Accumulator"))

    def total(self, value: float) -> float:
        """Collective: a one-sided sum at rank 0, then broadcast."""
        self.win.Fence()
        self.win.Accumulate(np.array([value]), 0, op=MPI.SUM)
        self.win.Fence()
        return float(comm.bcast(self.buf[0], root=0))


class GroupExchange:
    """Per-step objects on a sub-communicator: the even and the odd ranks.

    (Its window would sit here too, but Open MPI 4.1's osc/rdma here fails
    now and then to create windows on disjoint sub-communicators made by one
    split: see docs/petsc.md.)
    """

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.sub = cgc.split(comm, rank % 2)
        self.v = PETSc.Vec().createMPI(4, comm=self.sub)
        track(self.v)
        registrations.append(cp.manage(self, self.v, comm=self.sub, name="GroupExchange"))

    def group_norm(self, value: float) -> float:
        """Collective over the group."""
        self.v.set(value)
        return float(self.v.norm())


class Problem:
    """One step's state, in reference cycles with its parts."""

    def __init__(self, op: Operator, step: int) -> None:
        self.step = step
        self.cache = SolverCache(self, op.A)
        self.group = GroupExchange(self)
        self.acc = Accumulator(self)


def residual(A: PETSc.Mat, x: PETSc.Vec, b: PETSc.Vec) -> float:
    r = b.duplicate()  # a raw temporary: dropped, so PETSc's delayed destroy takes it
    A.mult(x, r)
    r.aypx(-1.0, b)
    return float(r.norm())


def total(value: float, op: MPI.Op = MPI.SUM) -> Any:
    return comm.allreduce(value, op=op)


def main() -> None:
    rng = random.Random(rank)
    # A different automatic-GC timing on every rank: left to itself, Python
    # would finalize the cycles at different steps on each rank.
    gc.set_threshold(200 + 400 * rank, 5 + 2 * rank, 10)
    noise: list[Any] = []
    iterations = 0
    stuck = 0
    say(f"solver loop: {size} ranks, {GRID * GRID} unknowns, {STEPS} steps")
    gc.callbacks.append(time_collector)
    t0 = time.perf_counter()
    with cgc.collective_scope(comm, gc="managed") as scope:
        cp.install(comm)
        op = Operator()
        for step in range(STEPS):
            problem = Problem(op, step)
            its = problem.cache.solve(1.0 + step % 7)  # a sync point after the solve
            iterations += its
            res = residual(op.A, problem.cache.x, problem.cache.b)
            group = problem.group.group_norm(float(its))
            summed = problem.acc.total(float(its))
            for _ in range(rng.randrange(50, 400)):  # per-rank cyclic noise
                cell: list[Any] = []
                cell.append(cell)
                noise.append(cell)
            if len(noise) > 3000:
                noise.clear()
            if (step + 1) % 20 == 0:
                pending = total(len(cgc.pending(comm)))
                garbage = total(len(cp.garbage(comm)) + len(cp.garbage(MPI.COMM_SELF)))
                stuck += total(len(cp.immortal(comm)))
                say(
                    f"  step {step + 1:4d}: {its:3d} CG iterations, residual {res:.1e}, "
                    f"sums {summed:.0f}/{group:.0f}; queued {pending:3d}, "
                    f"PETSc garbage {garbage:3d} (the residuals' temporaries, dropped since "
                    f"the solve's sync point), owners that never die {stuck}, "
                    f"{scope.syncs} sync points so far, {scope.collections} agreed collections"
                )
        del problem, op
    loop = time.perf_counter() - t0
    gc.callbacks.remove(time_collector)
    noise.clear()

    created = len(registrations)
    destroyed = sum(not r.alive for r in registrations)
    cyclic = sum(r.cyclic for r in registrations)
    pending = len(cgc.pending(comm))
    garbage = len(cp.garbage(comm)) + len(cp.garbage(MPI.COMM_SELF))
    petsc_alive = int(tracker.getRefCount()) - 1
    say("summary (sums over ranks, times the slowest rank):")
    say(
        f"  wrappers registered           {total(created):6d}"
        "  (3 per step and rank, + the operator)"
    )
    say(f"  destroyed at sync points      {total(destroyed):6d}")
    say(f"  still pending                 {total(pending):6d}")
    say(f"  PETSc garbage entries left    {total(garbage):6d}")
    say(f"  PETSc objects alive (PETSc's own count) {total(petsc_alive):d}")
    say(f"  sub-communicators made        {STEPS * min(size, 2):6d}  (and freed when dropped)")
    say(f"  cyclic finalizations seen     {total(cyclic):6d}")
    say(f"  sync points                   {scope.syncs:6d}, agreed collections {scope.collections}")
    sync_s = total(scope.seconds, MPI.MAX)
    loop_s = total(loop, MPI.MAX)
    say(
        f"  time in sync points           {sync_s:6.2f} s of {loop_s:.2f} s "
        f"({100 * sync_s / loop_s:.1f}%; {iterations} CG iterations on rank 0's count)"
    )
    say(
        f"    of which Python's collector {total(COLLECTOR[0], MPI.MAX):6.2f} s "
        "(the collections the ranks agreed on: automatic GC would make them elsewhere)"
    )
    say(
        f"  waiting for the slowest rank  {total(WAITED[0], MPI.MAX):6.2f} s "
        "(a barrier before each sync point, timed apart)"
    )
    bad = int(destroyed != created or pending or garbage or petsc_alive or stuck)
    ok = total(bad, MPI.MAX) == 0
    tracker.destroy()
    say("OK: every object destroyed exactly once, nothing left" if ok else "NOT CLEAN")
    if not ok:
        sys.exit(1)


def say(text: str) -> None:
    if rank == 0:
        print(text, flush=True)


if __name__ == "__main__":
    main()
