"""Dropping N PETSc Vecs on every rank: PETSc's own delayed destroy vs collective_gc.

(a) petsc4py's delayed destroy (Python drops the Vecs), then
    ``PETSc.garbage_cleanup(comm)``;
(b) the same Vecs, each held by a wrapper managed by collective_gc.petsc,
    wrappers dropped, then a sync point on ``comm``.

Timed from the drop to the end of the cleanup / sync point (the slowest
rank), interleaved in the same run, median of 9 and median of the per-repeat
ratios (b)/(a). Each setup ends with a full collection, so that neither timed
region pays for a collection the setup's allocations made due. The targets
are in bench/results/REPORT.md (bench/report.py). Also printed, to say where
(b)'s time goes: an explicit destroy loop of the same Vecs (the floor:
each Vec's ``destroy()`` called by hand, nothing agreed; interleaved too,
its median ratio to (a) printed and saved), (b) split
into the drop, the sync point and an empty sync point, and the median ratio
(b)/(a) of the CPU time of the slowest rank.

(b) destroys the Vecs from C (collective_gc._speedups) when the extension is
built; ``--python-destroys`` measures the pure-Python fallback instead (each
Vec's ``.destroy()`` called from Python).

Run: mpiexec -n 4 python bench/bench_petsc.py   (make bench)
``--no-save`` prints without writing bench/results; ``--repeats N`` (default 9).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from typing import Any

from mpi4py import MPI
from petsc4py import PETSc

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import collective_gc as cgc  # noqa: E402
from collective_gc import petsc as cp  # noqa: E402

from _common import paired, save, say, timed, timed_cpu  # noqa: E402

world = MPI.COMM_WORLD
REPEATS = 9


class Holder:
    """The smallest wrapper: owns one Vec."""

    __slots__ = ("vec", "__weakref__")

    def __init__(self, vec: Any) -> None:
        self.vec = vec


def run(n: int) -> dict[str, Any]:
    comm = world.Dup()
    template = PETSc.Vec().createMPI(8, comm=comm)  # duplicate() makes no MPI call
    box: list[Any] = []

    def make_raw() -> None:
        box[:] = [template.duplicate() for _ in range(n)]
        gc.collect()  # neither timed region starts with a collection pending

    def make_managed() -> None:
        holders = []
        for _ in range(n):
            h = Holder(template.duplicate())
            cp.manage(h, h.vec, comm=comm)
            holders.append(h)
        box[:] = holders
        gc.collect()

    def delayed() -> None:  # (a)
        box.clear()
        PETSc.garbage_cleanup(comm)

    def managed() -> None:  # (b)
        box.clear()
        cgc.collect(comm, generation=None)

    def explicit() -> None:  # reference: destroy each Vec by hand
        for v in box:
            v.destroy()
        box.clear()

    cp.install(comm)
    t_a, t_b, t_x, ratios, cpu_ratios, floors = [], [], [], [], [], []
    for _ in range(REPEATS):
        a, cpu_a = timed_cpu(comm, delayed, 1, make_raw)
        b, cpu_b = timed_cpu(comm, managed, 1, make_managed)
        x = timed(comm, explicit, 1, make_raw)
        t_a.append(a)
        t_b.append(b)
        t_x.append(x)
        ratios.append(b / a)
        cpu_ratios.append(cpu_b / cpu_a)
        floors.append(x / a)
    parts = breakdown(comm, make_managed, box)
    assert cp.garbage(comm) == [] and cgc.pending(comm) == []
    template.destroy()
    comm.Free()
    row = {
        "n": n,
        "delayed_ms": statistics.median(t_a) * 1e3,
        "managed_ms": statistics.median(t_b) * 1e3,
        "ratio": statistics.median(ratios),
        "cpu_ratio": statistics.median(cpu_ratios),
        "explicit_ms": statistics.median(t_x) * 1e3,
        "floor_ratio": statistics.median(floors),
        **{f"{k}_ms": v * 1e3 for k, v in parts.items()},
    }
    say(
        world,
        f"N={n:>6}: (a) delayed+garbage_cleanup {row['delayed_ms']:7.2f} ms   "
        f"(b) collective_gc {row['managed_ms']:7.2f} ms   ratio (b)/(a) {row['ratio']:.2f} "
        f"explicit destroy loop {row['explicit_ms']:7.2f} ms",
    )
    say(
        world,
        f"          the floor, an explicit destroy loop / (a): {row['floor_ratio']:.2f} "
        "(each Vec destroyed by hand, nothing agreed: what no sync point can beat)",
    )
    say(
        world,
        f"          CPU time of the slowest rank, (b)/(a): {row['cpu_ratio']:.2f} "
        "(with more ranks than cores, the wall times also hold waits for a core)",
    )
    say(
        world,
        "          (b) split: "
        + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in parts.items())
        + f"  ({(statistics.median(t_b) / n) * 1e6:.2f} us/Vec in all)",
    )
    return row


def empty_vs_garbage_cleanup(k: int = 500) -> dict[str, Any]:
    """The empty sync point of a communicator PETSc holds objects on, with
    collective_gc.petsc installed, against ``PETSc.garbage_cleanup`` there
    with nothing to clean: what Firedrake calls after every solve, on a
    mesh's communicator. (bench_core's row of the same name cleans a
    communicator PETSc has no objects on, where each cleanup makes and frees
    PETSc's inner communicator.) Interleaved, median of per-repeat ratios."""
    comm = world.Dup()
    held = PETSc.Vec().createMPI(8, comm=comm)  # PETSc's inner communicator lives
    cp.install(comm)

    def ours() -> None:
        for _ in range(k):
            cgc.collect(comm, generation=None)

    def base() -> None:
        for _ in range(k):
            PETSc.garbage_cleanup(comm)

    t_ours, t_base, ratio = paired(world, ours, base, REPEATS)
    held.destroy()
    cgc.collect(comm, generation=None)
    comm.Free()
    say(
        world,
        f"empty sync point with PETSc objects alive {t_ours / k * 1e6:.1f} us, "
        f"PETSc.garbage_cleanup there with nothing to clean {t_base / k * 1e6:.1f} us: "
        f"ratio {ratio:.2f}",
    )
    return {
        "bench": "sync_vs_garbage_cleanup_petsc_objects",
        "sync_us": t_ours / k * 1e6,
        "garbage_cleanup_us": t_base / k * 1e6,
        "ratio": ratio,
    }


def breakdown(comm: MPI.Comm, make: Any, box: list[Any]) -> dict[str, float]:
    """Where (b)'s time goes, on rank 0, median of REPEATS, through public calls
    only: the drop (finalizers queue), the sync point that agrees and destroys
    (PETSc's hook included), and an empty sync point after it (the fixed cost)."""
    samples: dict[str, list[float]] = {"drop": [], "sync": [], "empty sync": []}
    for _ in range(REPEATS):
        make()
        comm.Barrier()
        t0 = time.perf_counter()
        box.clear()
        t1 = time.perf_counter()
        cgc.collect(comm, generation=None)
        t2 = time.perf_counter()
        cgc.collect(comm, generation=None)
        t3 = time.perf_counter()
        for key, t in zip(samples, (t1 - t0, t2 - t1, t3 - t2)):
            samples[key].append(t)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    global REPEATS
    args = sys.argv[1:]
    if "--repeats" in args:
        REPEATS = int(args[args.index("--repeats") + 1])
    if "--python-destroys" in args:
        cp.batch_destroys(False)
    how = "from C" if cp.batch_destroys() else "from Python"
    say(
        world,
        f"bench_petsc: {world.Get_size()} ranks, PETSc {PETSc.Sys.getVersion()}, "
        f"(b)'s destroys {how}",
    )
    rows = [run(n) for n in (100, 1000, 10000)]
    for row in rows:
        row["destroys"] = how
    rows.append(empty_vs_garbage_cleanup())
    for row in rows:
        row["petsc"] = ".".join(map(str, PETSc.Sys.getVersion()))
    if "--no-save" not in sys.argv[1:]:
        name = "petsc" if how == "from C" else "petsc_python_destroys"
        save(name if world.Get_size() != 2 else f"{name}_2ranks", rows, world)


if __name__ == "__main__":
    main()
