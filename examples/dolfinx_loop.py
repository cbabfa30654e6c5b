"""A DOLFINx Poisson loop with XDMF output, its objects in reference cycles (issue 22).

Each step makes a mesh (DOLFINx duplicates the communicator for it, and for its
IndexMaps), a P1 space and a LinearProblem (CG + Jacobi), solves, writes the
solution to an open XDMFFile, and leaves its wrapper in cycles, as real codes do.
It runs on DOLFINx 0.5.2 (Debian 12) and 0.9.0 (Debian 13): ``make test-clients``.

    mpiexec -n 4 python -m mpi4py examples/dolfinx_loop.py [--steps N] [--mode M]

``--mode cgc`` (the default) is the documented path (docs/guides/fenicsx.rst,
:func:`manage_step`): one scope on COMM_WORLD; the PETSc objects are managed
on COMM_WORLD (they live on DOLFINx's own duplicates of it: collective_gc
reaches those); the LinearProblem (DOLFINx 0.9's ``__del__`` destroys its
PETSc objects), the XDMF file and the mesh (their C++ destructors are
collective) are kept and dropped at the sync point.
``--mode gc`` (plain GC: it leaks every PETSc object, and hangs with the open
XDMF file) and ``--mode collect`` (``gc.disable()`` + ``gc.collect()`` +
``PETSc.garbage_cleanup()`` per step) are there to compare. The last line
printed by rank 0 is a JSON summary.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import tempfile
import time
from typing import Any

# PT-Scotch 7.0.3's own threads (Debian 12's, under DOLFINx 0.5.2's mesh
# partitioner) make the ranks' partitioning diverge now and then: each rank
# ends up in a different collective of SCOTCH_dgraphPart and the job hangs in
# create_unit_square, with or without collective_gc (docs/guides/fenicsx.rst).
# One Scotch thread per rank; set before DOLFINx partitions its first mesh.
os.environ.setdefault("SCOTCH_PTHREAD_NUMBER", "1")

import dolfinx  # noqa: E402
import dolfinx.fem.petsc  # noqa: E402
import dolfinx.io  # noqa: E402
import ufl  # noqa: E402
from mpi4py import MPI  # noqa: E402
from petsc4py import PETSc  # noqa: E402

import collective_gc as cgc  # noqa: E402
from collective_gc import petsc as cp  # noqa: E402

WORLD = MPI.COMM_WORLD


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def petsc_log_alive() -> dict[str, int]:
    """This rank's PETSc objects created and not destroyed since
    ``PETSc.Log.begin()``, by type, from PETSc's own log (the "Object Type /
    Creations / Destructions" table of ``-log_view``), read through a viewer
    on COMM_SELF: not collective. The viewer it opens is not counted."""
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


# DOLFINx 0.7 made the space with functionspace(); FunctionSpace became the
# class that wraps a C++ space (0.9: FunctionSpace(mesh, element, cppV)).
functionspace = getattr(dolfinx.fem, "functionspace", None) or dolfinx.fem.FunctionSpace


class Step:
    """One step: mesh, space, problem, solution, output file, in cycles."""

    def __init__(self, n: int, out_dir: str, i: int, xdmf: bool) -> None:
        self.me = self  # a cycle, as real codes leave them
        self.mesh = dolfinx.mesh.create_unit_square(WORLD, n, n)
        V = functionspace(self.mesh, ("Lagrange", 1))
        u, v = ufl.TrialFunction(V), ufl.TestFunction(V)
        x = ufl.SpatialCoordinate(self.mesh)
        f = 10 * ufl.exp(-((x[0] - 0.5) ** 2 + (x[1] - 0.5) ** 2) / 0.02)
        a = ufl.inner(ufl.grad(u), ufl.grad(v)) * ufl.dx + u * v * ufl.dx
        # No petsc_options=: LinearProblem adds them to PETSc's global options
        # table and never removes them (512 at most: error 55 near step 170).
        self.problem = dolfinx.fem.petsc.LinearProblem(a, f * v * ufl.dx, bcs=[])
        self.problem.solver.setType("cg")
        self.problem.solver.getPC().setType("jacobi")
        self.callback = self.report  # a bound method: another cycle
        self.file = None
        if xdmf:
            self.file = dolfinx.io.XDMFFile(WORLD, os.path.join(out_dir, f"u{i % 2}.xdmf"), "w")

    def report(self) -> str:
        return f"step on {self.mesh.comm.Get_size()} ranks"

    def solve(self) -> Any:
        uh = self.problem.solve()
        if self.file is not None:
            self.file.write_mesh(self.mesh)
            self.file.write_function(uh)
        return uh


def manage_step(step: Step) -> None:
    """The documented registrations of one step (docs/guides/fenicsx.rst), on
    DOLFINx 0.5.2 and 0.9 alike. Collective over WORLD.

    The PETSc objects are managed on WORLD (they live on DOLFINx's duplicates
    of it, the mesh's and the IndexMap's). The step keeps what has a
    collective destructor and no destroy call to register: the XDMF file (its
    HDF5 close), the mesh (it frees its communicator) and the LinearProblem,
    whose ``__del__`` in DOLFINx 0.9 (0.5.2 has none) destroys its KSP, Mat
    and Vecs: held by the registration, it survives the collection that finds
    the step dead and goes at the sync point, on every rank in the agreed
    order, whichever way the scope collects (gc="auto": when each rank's
    collector fires). The managed destroys and the problem's ``__del__`` then
    run at the same sync point; the second to reach an object finds it
    destroyed (petsc4py's destroy() of a destroyed object does nothing).
    """
    p = step.problem
    cp.manage(step, p.solver, p.A, p.b, p._x, comm=WORLD)
    # Dropped last first: this reference to the mesh, the file (its collective
    # close), then the problem (its destroys, then the forms and the mesh).
    cgc.keep(step, p, *[r for r in (step.file, step.mesh) if r is not None], comm=WORLD)


def run(
    mode: str, steps: int, n: int = 32, xdmf: bool = True, out_dir: str | None = None
) -> dict[str, Any]:
    """The loop in one mode; returns this rank's figures (bench/bench_dolfinx.py
    runs it once per mode). Collective."""
    if out_dir is None:
        out_dir = tempfile.mkdtemp(prefix="cgc-dolfinx-") if WORLD.rank == 0 else ""
        out_dir = WORLD.bcast(out_dir)
    rss: list[int] = []
    sync_s = wait_s = 0.0

    def wait_apart() -> None:
        # The wait for the slowest rank, timed apart: without this barrier
        # the collective that follows (a sync point, garbage_cleanup) would
        # absorb the ranks' skew and count it as its own.
        nonlocal wait_s
        w0 = time.perf_counter()
        WORLD.Barrier()
        wait_s += time.perf_counter() - w0

    WORLD.Barrier()
    t0 = time.perf_counter()
    if mode == "cgc":
        with cgc.collective_scope(WORLD, timeout=120) as scope:
            for i in range(steps):
                step = Step(n, out_dir, i, xdmf)
                manage_step(step)
                step.solve()
                del step
                # The step's cycles die: the scope's collector is off, so the
                # dead step is young (a full collection cost 60-100 ms a step
                # on 4 ranks, issue 41).
                gc.collect(0)
                wait_apart()
                s0 = time.perf_counter()
                scope.sync()
                sync_s += time.perf_counter() - s0
                rss.append(rss_kib())
    else:
        if mode == "collect":
            gc.disable()
        try:
            for i in range(steps):
                step = Step(n, out_dir, i, xdmf)
                step.solve()
                del step
                wait_apart()
                if mode == "collect":
                    s0 = time.perf_counter()
                    gc.collect()
                    PETSc.garbage_cleanup()
                    sync_s += time.perf_counter() - s0
                rss.append(rss_kib())
        finally:
            gc.enable()
    total = time.perf_counter() - t0
    gc.collect()
    PETSc.garbage_cleanup()
    start = min(20, len(rss) - 1)
    return {
        "mode": mode,
        "steps": steps,
        "xdmf": xdmf,
        "ms_per_step": 1e3 * total / steps,
        "sync_share": sync_s / total,
        "wait_share": wait_s / total,
        "rss_kib_per_step": (rss[-1] - rss[start]) / max(1, len(rss) - 1 - start),
        "petsc_garbage_world": len(cp.garbage(WORLD)),
        "pending": sum(len(m.pending()) + m.registered for m in cgc.managers()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--mode", choices=("cgc", "gc", "collect"), default="cgc")
    parser.add_argument("--no-xdmf", action="store_true")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 unless RSS <= 40 KiB/step and nothing is left"
    )
    args = parser.parse_args()
    mine = run(args.mode, args.steps, args.n, not args.no_xdmf)
    summaries = WORLD.gather(mine)
    if WORLD.rank == 0:
        summary = dict(mine)
        summary["rss_kib_per_step"] = max(s["rss_kib_per_step"] for s in summaries)
        summary["pending_by_rank"] = [s["pending"] for s in summaries]
        print(json.dumps(summary), flush=True)
        bad = summary["rss_kib_per_step"] > 40 or any(summary["pending_by_rank"])
        if args.check and bad:
            raise SystemExit(f"dolfinx_loop: over budget: {summary}")


if __name__ == "__main__":
    main()
