"""A SLEPc eigenvalue loop, its objects in reference cycles (issue 33).

Each step builds the 1-D Laplacian (an MPIAIJ matrix on COMM_WORLD) and an
EPS that finds its smallest eigenvalues by shift-and-invert (the ST, its KSP
and an LU factorization by MUMPS inside), solves, reads the eigenpairs into
its own Vecs, and leaves its wrapper in cycles, as real codes do.

    mpiexec -n 4 python -m mpi4py examples/slepc_loop.py [--steps N] [--mode M] [--check]

(Debian 12's slepc4py 3.18 and Debian 13's 3.22 import without SLEPC_DIR:
``make test-clients`` runs it on both.)

``--mode cgc`` (the default) is the documented path (docs/guides/slepc.rst):
one scope on COMM_WORLD, the step's PETSc and SLEPc objects managed with
``collective_gc.petsc.manage(step, A, xr, xi, eps, comm=WORLD)`` and
destroyed at the sync point, every rank in the same order. ``--mode gc``
(plain GC: petsc4py hands every object to PETSc's garbage, which nothing
cleans) and ``--mode collect`` (``gc.disable()`` + ``gc.collect()`` +
``PETSc.garbage_cleanup()`` per step) are there to compare. The last line
printed by rank 0 is a JSON summary; ``--check`` exits 1 unless every step
found the right eigenvalues, RSS grew by at most 20 KiB a step from step
20, PETSc's own log shows no object left and nothing is pending.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import tempfile
import time
from typing import Any

from mpi4py import MPI
from petsc4py import PETSc
from slepc4py import SLEPc

import collective_gc as cgc
from collective_gc import petsc as cp

WORLD = MPI.COMM_WORLD
NEV = 4


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def petsc_log_alive() -> dict[str, int]:
    """This rank's PETSc objects (SLEPc's included) created and not destroyed
    since ``PETSc.Log.begin()``, by type, from PETSc's own log (the "Object
    Type / Creations / Destructions" table of ``-log_view``), read through a
    viewer on COMM_SELF: not collective. The viewer it opens is not counted."""
    fd, path = tempfile.mkstemp(prefix="cgc-petsc-log-", suffix=".txt")
    os.close(fd)
    try:
        viewer = PETSc.Viewer().createASCII(path, comm=PETSc.COMM_SELF)
        PETSc.Log.view(viewer)
        viewer.destroy()
        with open(path) as f:
            text = f.read()
    finally:
        os.unlink(path)
    alive: dict[str, int] = {}
    table = text.split("Object Type", 1)[1].split("=" * 20, 1)[0]
    for line in table.splitlines()[1:]:
        # "       Krylov Solver     1              1" (one row per type and stage)
        m = re.match(r"\s*(\S.*?)\s+(\d+)\s+(\d+)(?:\s|$)", line)
        if m:
            name = m.group(1)
            alive[name] = alive.get(name, 0) + int(m.group(2)) - int(m.group(3))
    alive["Viewer"] = alive.get("Viewer", 0) - 1  # the one that printed the table
    return {k: v for k, v in alive.items() if v}


def exact(n: int) -> list[float]:
    """The NEV smallest eigenvalues of the n x n matrix tridiag(-1, 2, -1)."""
    return [2.0 - 2.0 * math.cos(k * math.pi / (n + 1)) for k in range(1, NEV + 1)]


class Step:
    """One step: the matrix, the eigensolver, the eigenvectors, in cycles."""

    def __init__(self, n: int) -> None:
        self.me = self  # a cycle, as real codes leave them
        self.n = n
        A = PETSc.Mat().createAIJ([n, n], nnz=3, comm=WORLD)
        start, end = A.getOwnershipRange()
        for i in range(start, end):
            cols = [j for j in (i - 1, i, i + 1) if 0 <= j < n]
            A.setValues(i, cols, [2.0 if j == i else -1.0 for j in cols])
        A.assemble()
        self.A = A
        eps = SLEPc.EPS().create(comm=WORLD)
        eps.setOperators(A)
        eps.setProblemType(SLEPc.EPS.ProblemType.HEP)
        eps.setDimensions(NEV)
        eps.setTarget(0.0)
        eps.setWhichEigenpairs(SLEPc.EPS.Which.TARGET_MAGNITUDE)
        st = eps.getST()
        st.setType(SLEPc.ST.Type.SINVERT)
        ksp = st.getKSP()
        ksp.setType(PETSc.KSP.Type.PREONLY)
        pc = ksp.getPC()
        pc.setType(PETSc.PC.Type.LU)
        pc.setFactorSolverType(PETSc.Mat.SolverType.MUMPS)
        eps.setTolerances(1e-10, 200)
        self.eps = eps
        self.xr, self.xi = A.createVecs()
        self.callback = self.report  # a bound method: another cycle

    def report(self) -> str:
        return f"EPS of size {self.n} on {WORLD.size} ranks"

    def solve(self) -> list[float]:
        self.eps.solve()
        nconv = self.eps.getConverged()
        values = []
        for k in range(min(nconv, NEV)):
            value = self.eps.getEigenpair(k, self.xr, self.xi)
            values.append(value.real)
        return sorted(values)


def run(mode: str, steps: int, n: int = 400) -> dict[str, Any]:
    """The loop in one mode; returns this rank's figures. Collective."""
    want = exact(n)
    wrong: list[int] = []
    rss: list[int] = []
    sync_s = 0.0
    gc.collect()
    PETSc.garbage_cleanup()
    PETSc.Log.begin()
    before = petsc_log_alive()
    WORLD.Barrier()
    t0 = time.perf_counter()
    if mode == "cgc":
        with cgc.collective_scope(WORLD, timeout=120) as scope:
            for i in range(steps):
                step = Step(n)
                cp.manage(step, step.A, step.xr, step.xi, step.eps, comm=WORLD)
                got = step.solve()
                if len(got) < NEV or max(abs(a - b) for a, b in zip(got, want)) > 1e-8:
                    wrong.append(i)
                del step
                s0 = time.perf_counter()
                # PETSc's and MUMPS's memory is invisible to Python's
                # collector, which counts Python allocations: a step makes
                # about ten, so the dead steps (~280 KiB each here) would
                # wait ~70 steps for it. The automatic collector is off in a
                # managed scope, so the step is still young: a young
                # collection finds it.
                gc.collect(0)
                scope.sync()
                sync_s += time.perf_counter() - s0
                rss.append(rss_kib())
    else:
        if mode == "collect":
            gc.disable()
        try:
            for i in range(steps):
                step = Step(n)
                got = step.solve()
                if len(got) < NEV or max(abs(a - b) for a, b in zip(got, want)) > 1e-8:
                    wrong.append(i)
                del step
                if mode == "collect":
                    s0 = time.perf_counter()
                    gc.collect()
                    PETSc.garbage_cleanup()
                    sync_s += time.perf_counter() - s0
                rss.append(rss_kib())
        finally:
            gc.enable()
    total = time.perf_counter() - t0
    left = petsc_log_alive()
    leaked = {k: v - before.get(k, 0) for k, v in left.items() if v != before.get(k, 0)}
    start = min(20, len(rss) - 1)
    return {
        "mode": mode,
        "steps": steps,
        "n": n,
        "ms_per_step": 1e3 * total / steps,
        "sync_share": sync_s / total,
        "rss_kib_per_step": (rss[-1] - rss[start]) / max(1, len(rss) - 1 - start),
        "wrong_steps": wrong,
        "petsc_objects_left": leaked,
        "pending": sum(len(m.pending()) + m.registered for m in cgc.managers()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--n", type=int, default=400)
    parser.add_argument("--mode", choices=("cgc", "gc", "collect"), default="cgc")
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 unless the eigenvalues are right, RSS <= 20 KiB/step and nothing is left",
    )
    args = parser.parse_args()
    mine = run(args.mode, args.steps, args.n)
    summaries = WORLD.gather(mine)
    if WORLD.rank == 0:
        summary = dict(mine)
        summary["rss_kib_per_step"] = max(s["rss_kib_per_step"] for s in summaries)
        summary["wrong_steps"] = sorted({w for s in summaries for w in s["wrong_steps"]})
        summary["petsc_objects_left_by_rank"] = [s["petsc_objects_left"] for s in summaries]
        summary["pending_by_rank"] = [s["pending"] for s in summaries]
        del summary["petsc_objects_left"], summary["pending"]
        print(json.dumps(summary), flush=True)
        bad = (
            summary["rss_kib_per_step"] > 20
            or summary["wrong_steps"]
            or any(summary["petsc_objects_left_by_rank"])
            or any(summary["pending_by_rank"])
        )
        if args.check and bad:
            raise SystemExit(f"slepc_loop: over budget: {summary}")


if __name__ == "__main__":
    main()
