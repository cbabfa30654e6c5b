"""The DOLFINx loop in every mode, one job.

    tools/mpirun 4 900 .venv/bin/python -m mpi4py bench/bench_dolfinx.py [--steps 200]

For plain GC, ``gc.disable()`` + ``gc.collect()`` + ``PETSc.garbage_cleanup()``
per step, and collective_gc (examples/dolfinx_loop.py's ``run``, no XDMF file:
plain GC hangs with one; collective_gc is run with it too): ms per step, RSS
growth per step from step 20 on (the worst rank), the sync points' share of the
step (a barrier just before each sync point, or garbage_cleanup, in every
mode: the wait for the slowest rank is timed apart and given on its own), and
the PETSc objects each rank has left after the mode (PETSc's own log:
creations minus destructions). Each mode's time is also given as a ratio to the
plain-GC run of the same job, and to the ``collect`` mode (what a user would
call instead). ``--profile`` adds where collective_gc's sync
points spend their time on rank 0 (cProfile, by function, cumulative), the
cost of an empty sync point right after a step's against one before any mesh,
and the share of sync points that took the steady state.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import dolfinx_loop as loop  # noqa: E402  (sets SCOTCH_PTHREAD_NUMBER=1 first)
from mpi4py import MPI  # noqa: E402
from petsc4py import PETSc  # noqa: E402

import collective_gc as cgc  # noqa: E402
from collective_gc import petsc as cp  # noqa: E402
from collective_gc import testing  # noqa: E402

from _common import save, say  # noqa: E402

WORLD = MPI.COMM_WORLD
EMPTY_RUN = 50  # empty sync points in a row, timed together


def empty_syncs(scope: Any, n: int = EMPTY_RUN) -> float:
    """Seconds per call of ``n`` sync points in a row with nothing queued."""
    WORLD.Barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        scope.sync()
    return (time.perf_counter() - t0) / n


def profile_sync(steps: int, n: int) -> str:
    """The collective_gc loop again, its sync points under cProfile on rank 0:
    the top of the profile by cumulative time, with the time a barrier just
    before each sync point waits (the ranks' skew, which the sync point would
    otherwise absorb), EMPTY_RUN empty sync points in a row after each real
    one and before any mesh (our own floor: the agreement with nothing
    queued, after a step and with nothing made yet), and how many of all
    these sync points took the steady state (collective_gc.testing).
    Collective."""
    prof = cProfile.Profile()
    skew = syncs = after = 0.0
    with testing.outcomes() as ways, cgc.collective_scope(WORLD, timeout=120) as scope:
        cp.install(WORLD)  # as the loop's first cp.manage does
        scope.sync()
        before = empty_syncs(scope)
        for i in range(steps):
            step = loop.Step(n, "", i, xdmf=False)
            p = step.problem
            cp.manage(step, p.solver, p.A, p.b, p._x, comm=WORLD)
            cgc.keep(p, step.mesh, comm=WORLD)
            step.solve()
            del step, p
            gc.collect()
            b0 = time.perf_counter()
            WORLD.Barrier()  # the wait for the slowest rank, apart
            t0 = time.perf_counter()
            skew += t0 - b0
            if WORLD.rank == 0:
                prof.enable()
            scope.sync()
            if WORLD.rank == 0:
                prof.disable()
            syncs += time.perf_counter() - t0
            after += empty_syncs(scope)
    steady = ways.count("steady")
    out = io.StringIO()
    if WORLD.rank == 0:  # the other ranks profiled nothing
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
    return (
        f"rank {WORLD.rank}: a barrier before each sync point {1e3 * skew / steps:.2f} ms"
        f" (waiting for the slowest rank), then the sync point {1e3 * syncs / steps:.2f} ms;"
        f" {EMPTY_RUN} empty ones right after it {1e6 * after / steps:.1f} us a call,"
        f" before any mesh {1e6 * before:.1f} us: ratio {after / steps / before:.2f};"
        f" sync points that took the steady state {steady} of {len(ways)}"
        f" ({100 * steady / max(1, len(ways)):.1f}%)\n" + out.getvalue()
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    out_dir = WORLD.bcast(loop.tempfile.mkdtemp(prefix="cgc-dolfinx-") if WORLD.rank == 0 else "")
    PETSc.Log.begin()
    rows: list[dict[str, Any]] = []
    base_ms = None
    collect_ms = 0.0
    for mode, xdmf in (("gc", False), ("collect", False), ("cgc", False), ("cgc", True)):
        before = sum(loop.petsc_log_alive().values())
        mine = loop.run(mode, args.steps, args.n, xdmf, out_dir)
        mine["petsc_left"] = sum(loop.petsc_log_alive().values()) - before
        every = WORLD.allgather(mine)
        row = {
            "mode": mode + (" + XDMF" if xdmf else ""),
            "steps": args.steps,
            "ms_per_step": max(r["ms_per_step"] for r in every),
            "rss_kib_per_step": max(r["rss_kib_per_step"] for r in every),
            "sync_share": max(r["sync_share"] for r in every),
            "wait_share": max(r["wait_share"] for r in every),
            "petsc_left_by_rank": [r["petsc_left"] for r in every],
            "pending_by_rank": [r["pending"] for r in every],
        }
        if base_ms is None:
            base_ms = row["ms_per_step"]
        if mode == "collect":
            collect_ms = row["ms_per_step"]
        row["ratio_to_plain_gc"] = row["ms_per_step"] / base_ms
        row["ratio_to_collect"] = row["ms_per_step"] / collect_ms if collect_ms else None
        rows.append(row)
        vs_collect = row["ratio_to_collect"]
        say(
            WORLD,
            f"{row['mode']:14s} {row['ms_per_step']:7.1f} ms/step"
            f" ({row['ratio_to_plain_gc']:.2f}x plain GC"
            + (f", {vs_collect:.2f}x collect)" if vs_collect else ")")
            + f"  RSS {row['rss_kib_per_step']:+8.1f} KiB/step"
            f"  sync {100 * row['sync_share']:5.1f}% of the step"
            f" (+ {100 * row['wait_share']:4.1f}% waiting for the slowest rank)"
            f"  PETSc objects left per rank {row['petsc_left_by_rank']}"
            f"  pending {row['pending_by_rank']}",
        )
    save("dolfinx", rows, WORLD)
    if args.profile:
        text = profile_sync(min(args.steps, 100), args.n)
        say(WORLD, text)


if __name__ == "__main__":
    main()
