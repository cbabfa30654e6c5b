"""A Firedrake-like solver step: what a user pays per solve, ours against plain petsc4py.

Each step makes a KSP and two Vecs on one communicator (a mesh's), drops
them, and cleans up, as Firedrake's ``NonlinearVariationalSolver.solve()``
does after every solve:

(a) plain petsc4py: the objects are dropped (petsc4py >= 3.18 hands them to
    PETSc's delayed destroy), then ``PETSc.garbage_cleanup(comm)``;
(b) collective_gc: a small owner holds them, ``cp.manage(owner, ksp, x, b,
    comm=comm)``, the owner is dropped, then ``cgc.collect(comm,
    generation=None)`` (each object dies by refcounting: no collection in
    either).

The same with each step's objects dropped KEPT (24) steps later, as a
solver cache keeps them: their keys are then older than the sync points
just before, which the agreement must still reach in one round.

Also, per object: ``cp.manage`` of one Vec (register + drop + queue) against
a ``weakref.finalize`` of the same (create + drop), with the Vec made outside
the timed region in both; wall and CPU time (4 ranks on 2 cores: a rank's loop
of a few ms is cut by the scheduler on some repeats, which only the wall
holds).

Interleaved blocks of STEPS steps, medians of REPEATS blocks and of the
per-block ratios, slowest rank. The split of (b) (creating, ``manage``, the
sync point) is timed on rank 0 with the same calls, to say where its time goes.

Run: mpiexec -n 4 python -m mpi4py bench/bench_step.py   (make bench runs it at
4 ranks and at 2; ``--no-save`` prints without writing bench/results,
``--profile`` prints cProfile's top entries of 2,000 steps of (b) on rank 0)
"""

from __future__ import annotations

import collections
import cProfile
import pstats
import statistics
import sys
import time
import weakref
from typing import Any

from mpi4py import MPI
from petsc4py import PETSc

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import collective_gc as cgc  # noqa: E402
from collective_gc import petsc as cp  # noqa: E402

from _common import paired, save, say, timed_cpu  # noqa: E402

world = MPI.COMM_WORLD
REPEATS = 9
STEPS = 200


class Step:
    """The owner a library's solver wrapper would be."""

    __slots__ = ("ksp", "x", "b", "__weakref__")


def noop(*args: object) -> None:
    pass


def make(comm: MPI.Comm) -> tuple[Any, Any, Any]:
    ksp = PETSc.KSP().create(comm)
    x = PETSc.Vec().createMPI(8, comm=comm)
    b = x.duplicate()
    return ksp, x, b


def plain_steps(comm: MPI.Comm) -> None:
    cleanup = PETSc.garbage_cleanup
    for _ in range(STEPS):
        ksp, x, b = make(comm)
        del ksp, x, b
        cleanup(comm)


def managed_steps(comm: MPI.Comm) -> None:
    manage, collect = cp.manage, cgc.collect
    for _ in range(STEPS):
        s = Step()
        s.ksp, s.x, s.b = make(comm)
        manage(s, s.ksp, s.x, s.b, comm=comm)
        del s
        collect(comm, generation=None)


KEPT = 24  # how many steps (b') keeps each step's objects: a solver cache's life


def plain_kept(comm: MPI.Comm) -> None:
    """(a) with each step's objects dropped KEPT steps later."""
    cleanup = PETSc.garbage_cleanup
    ring: collections.deque[Any] = collections.deque()
    for _ in range(STEPS):
        ring.append(make(comm))
        if len(ring) > KEPT:
            ring.popleft()
        cleanup(comm)
    ring.clear()
    cleanup(comm)


def managed_kept(comm: MPI.Comm) -> None:
    """(b) with each step's owner dropped KEPT steps later (keys older than
    the sync points just before: the agreement's window must reach them)."""
    manage, collect = cp.manage, cgc.collect
    ring: collections.deque[Step] = collections.deque()
    for _ in range(STEPS):
        s = Step()
        s.ksp, s.x, s.b = make(comm)
        manage(s, s.ksp, s.x, s.b, comm=comm)
        ring.append(s)
        del s
        if len(ring) > KEPT:
            ring.popleft()
        collect(comm, generation=None)
    ring.clear()
    collect(comm, generation=None)


def step_split(comm: MPI.Comm) -> dict[str, float]:
    """(b)'s parts on rank 0, µs per step: creating, manage, the sync point."""
    clock = time.perf_counter
    parts: dict[str, list[float]] = {"create": [], "manage": [], "sync": []}
    for _ in range(REPEATS):
        t_make = t_manage = t_sync = 0.0
        for _ in range(STEPS):
            t0 = clock()
            s = Step()
            s.ksp, s.x, s.b = make(comm)
            t1 = clock()
            cp.manage(s, s.ksp, s.x, s.b, comm=comm)
            t2 = clock()
            del s
            cgc.collect(comm, generation=None)
            t3 = clock()
            t_make += t1 - t0
            t_manage += t2 - t1
            t_sync += t3 - t2
        for key, t in zip(parts, (t_make, t_manage, t_sync)):
            parts[key].append(t / STEPS * 1e6)
    return {k: statistics.median(v) for k, v in parts.items()}


def per_object(comm: MPI.Comm, n: int = 2000) -> dict[str, float]:
    """``cp.manage`` of one Vec against a ``weakref.finalize``: create the
    owner, register, drop (the finalizer queues). The Vecs are made before."""
    template = PETSc.Vec().createMPI(8, comm=comm)
    vecs: list[Any] = []

    def setup() -> None:
        vecs[:] = [template.duplicate() for _ in range(n)]

    def ours() -> None:
        manage = cp.manage
        for v in vecs:
            s = Step()
            s.x = v
            manage(s, v, comm=comm)
            del s

    def base() -> None:
        fin = weakref.finalize
        for v in vecs:
            s = Step()
            s.x = v
            fin(s, noop, v)
            del s

    def clean() -> None:
        cgc.collect(comm, generation=None)
        PETSc.garbage_cleanup(comm)

    # Interleaved, each timed region given fresh Vecs (made untimed). The CPU
    # times beside: with more ranks than cores, a loop of a few ms is cut by
    # the scheduler on some repeats and not others, which the wall time holds.
    ratios, t_ours, t_base, c_ours, c_base = [], [], [], [], []
    for _ in range(REPEATS):
        b, bc = timed_cpu(comm, base, 1, setup)
        clean()
        o, oc = timed_cpu(comm, ours, 1, setup)
        clean()
        t_ours.append(o)
        t_base.append(b)
        c_ours.append(oc)
        c_base.append(bc)
        ratios.append(o / b)
    vecs.clear()
    cgc.collect(comm, generation=None)
    PETSc.garbage_cleanup(comm)
    template.destroy()
    return {
        "manage_us": statistics.median(t_ours) / n * 1e6,
        "finalize_us": statistics.median(t_base) / n * 1e6,
        "manage_cpu_us": statistics.median(c_ours) / n * 1e6,
        "finalize_cpu_us": statistics.median(c_base) / n * 1e6,
        "ratio": statistics.median(ratios),
    }


def main() -> None:
    global REPEATS
    args = sys.argv[1:]
    if "--repeats" in args:
        REPEATS = int(args[args.index("--repeats") + 1])
    size = world.Get_size()
    comm = world.Dup()
    cp.install(comm)
    # Warm both paths (PETSc's inner communicator, the family, the caches).
    for _ in range(3):
        plain_steps(comm)
        managed_steps(comm)
    if "--profile" in args:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            managed_steps(comm)
        prof.disable()
        if world.Get_rank() == 0:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    say(
        world,
        f"bench_step: {size} ranks, PETSc {'.'.join(map(str, PETSc.Sys.getVersion()))}, "
        f"{STEPS} steps a block, median of {REPEATS} blocks, slowest rank",
    )
    t_ours, t_base, ratio = paired(
        world, lambda: managed_steps(comm), lambda: plain_steps(comm), REPEATS
    )
    k_ours, k_base, k_ratio = paired(
        world, lambda: managed_kept(comm), lambda: plain_kept(comm), REPEATS
    )
    split = step_split(comm)
    say(
        world,
        f"step (KSP + 2 Vecs made, dropped, cleaned): collective_gc "
        f"{t_ours / STEPS * 1e6:.1f} us, plain petsc4py + garbage_cleanup "
        f"{t_base / STEPS * 1e6:.1f} us: ratio {ratio:.2f}",
    )
    say(
        world,
        f"step, its objects dropped {KEPT} steps later: collective_gc "
        f"{k_ours / STEPS * 1e6:.1f} us, plain petsc4py + garbage_cleanup "
        f"{k_base / STEPS * 1e6:.1f} us: ratio {k_ratio:.2f}",
    )
    say(
        world,
        "          collective_gc's step on rank 0: "
        + ", ".join(f"{k} {v:.1f} us" for k, v in split.items()),
    )
    one = per_object(comm)
    say(
        world,
        f"cp.manage of one Vec (register + drop + queue) {one['manage_us']:.2f} us, "
        f"weakref.finalize of the same {one['finalize_us']:.2f} us: ratio {one['ratio']:.2f} "
        f"(CPU time {one['manage_cpu_us']:.2f} ; {one['finalize_cpu_us']:.2f} us)",
    )
    assert cgc.pending(comm) == [] and cp.garbage(comm) == []
    cgc.collect(comm, generation=None)
    rows = [
        {
            "bench": "firedrake_step",
            "ours_us": t_ours / STEPS * 1e6,
            "base_us": t_base / STEPS * 1e6,
            "ratio": ratio,
            **{f"{k}_us": v for k, v in split.items()},
        },
        {
            "bench": "firedrake_step_kept",
            "kept": KEPT,
            "ours_us": k_ours / STEPS * 1e6,
            "base_us": k_base / STEPS * 1e6,
            "ratio": k_ratio,
        },
        {"bench": "manage_one", **one},
    ]
    if "--no-save" not in args:
        save("step" if size != 2 else "step_2ranks", rows, world)


if __name__ == "__main__":
    main()
