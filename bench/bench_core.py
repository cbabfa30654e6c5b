"""Core costs on all ranks of COMM_WORLD, each beside a baseline from the same run.

1. register + drop + queue per object, beside a bare weakref.finalize create + drop.
2. sync-point cost with 0, 1e3, 1e4, 1e5 pending, beside one Allreduce of 8 int64,
   and the empty sync again after the large backlog was destroyed.
3. the floor of the empty sync point: its own allreduce alone, started and
   completed as the sync point does (non-blocking, so that a rank with a
   timeout can give up), with no Python around it; beside the same Allreduce.
4. the empty sync point beside what a PETSc user calls instead after every
   solve (Firedrake does): ``PETSc.garbage_cleanup(comm)`` with nothing in
   the garbage.
5. the empty sync point with 100 live ``cgc.dup``s of its communicator (one
   live registration each), beside the same with none; and how many MPI
   communicators a ``cgc.dup`` holds (a plain ``Dup`` holds one).

Run: mpiexec -n 4 python bench/bench_core.py   (make bench runs it at 4 ranks
and at 2, a core each, where a collective is not a wait for a core; the
2-rank figures go to core_2ranks.json)
"""

from __future__ import annotations

import array
import gc
import sys
import weakref
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import collective_gc as cgc  # noqa: E402

from _common import paired, save, say  # noqa: E402

comm = MPI.COMM_WORLD
REPEATS = 5


class Res:
    pass


def noop(*args: object) -> None:
    pass


def per_object(n: int = 20000) -> list[dict[str, object]]:
    c = comm.Dup()
    cgc.manager(c)

    def ours() -> None:
        reg = cgc.register
        for _ in range(n):
            reg(Res(), noop, comm=c)

    def base() -> None:
        fin = weakref.finalize
        for _ in range(n):
            fin(Res(), noop)

    # Destroy between repeats (untimed), as a sync point would.
    t_ours, t_base, ratio = paired(
        comm, ours, base, REPEATS, setup=lambda: cgc.collect(c, generation=None)
    )
    cgc.collect(c, generation=None)
    say(
        comm,
        f"register+drop+queue: {t_ours / n * 1e6:6.2f} us/object   "
        f"weakref.finalize create+drop: {t_base / n * 1e6:6.2f} us   "
        f"ratio {ratio:.2f}",
    )
    return [
        {
            "bench": "per_object",
            "ours_us": t_ours / n * 1e6,
            "base_us": t_base / n * 1e6,
            "ratio": ratio,
        }
    ]


def sync_costs() -> list[dict[str, object]]:
    c = comm.Dup()
    cgc.manager(c)
    a = np.zeros(8, dtype=np.int64)
    b = np.empty_like(a)
    k = 500

    def allreduce() -> None:
        for _ in range(k):
            c.Allreduce(a, b, MPI.MAX)

    def empty_sync() -> None:
        for _ in range(k):
            cgc.collect(c, generation=None)

    t_empty, t_ar, r_empty = paired(comm, empty_sync, allreduce, REPEATS)
    t_empty, t_ar = t_empty / k, t_ar / k
    rows = [
        {
            "bench": "sync",
            "pending": 0,
            "sync_us": t_empty * 1e6,
            "allreduce_us": t_ar * 1e6,
            "ratio": r_empty,
        }
    ]
    say(comm, f"Allreduce(8 int64): {t_ar * 1e6:8.1f} us")
    say(
        comm,
        f"sync,      0 pending: {t_empty * 1e6:10.1f} us   ratio to Allreduce {r_empty:7.2f}",
    )
    rows.append(floor(c, allreduce, k, t_empty))
    rows.extend(against_garbage_cleanup(c, empty_sync, k))
    holders: list[Res] = []

    def fill(n: int) -> None:
        holders.extend(Res() for _ in range(n))
        for h in holders:
            cgc.register(h, noop, comm=c)
        holders.clear()

    for n in (1000, 10000, 100000):
        t, t_ar_n, r = paired(
            comm,
            lambda: cgc.collect(c, generation=None),
            allreduce,
            REPEATS,
            setup=lambda n=n: fill(n),
        )
        rows.append(
            {
                "bench": "sync",
                "pending": n,
                "sync_us": t * 1e6,
                "allreduce_us": t_ar_n / k * 1e6,
                "ratio": r * k,
                "us_per_key": t / n * 1e6,
            }
        )
        say(
            comm,
            f"sync, {n:6d} pending: {t * 1e6:10.1f} us   ratio to Allreduce {r * k:7.1f}   "
            f"{t / n * 1e6:.2f} us/key",
        )
    gc.collect()
    t_after, t_ar2, r_after = paired(comm, empty_sync, allreduce, REPEATS)
    rows.append(
        {
            "bench": "sync_after_backlog",
            "pending": 0,
            "sync_us": t_after / k * 1e6,
            "allreduce_us": t_ar2 / k * 1e6,
            "ratio": r_after,
        }
    )
    say(
        comm,
        f"sync, 0 pending after 3.3e5 destroyed: {t_after / k * 1e6:.1f} us   "
        f"ratio to Allreduce {r_after:.2f}   (before: {r_empty:.2f})",
    )
    return rows


def floor(
    c: MPI.Intracomm, allreduce: Callable[[], None], k: int, t_empty: float
) -> dict[str, object]:
    """The empty sync point's allreduce alone: MPI_BAND in place over a message
    of its length (6 header words, a deadline word per rank, a 256-bit window),
    persistent where mpi4py and the MPI offer it (mpi4py 4), else Iallreduce;
    completed with Wait, as a sync point without a timeout does. What the
    sync point costs beyond this is its Python."""
    words = cgc.manager(c).message
    buf = array.array("q", bytes(8 * (words[0] if words else 12)))
    how = "Iallreduce"
    pers = None
    init = getattr(c, "Allreduce_init", None)
    if init is not None:
        try:
            pers = init(MPI.IN_PLACE, buf, MPI.BAND)
            how = "persistent Allreduce_init"
        except NotImplementedError:
            pass

    def own() -> None:
        if pers is not None:
            for _ in range(k):
                pers.Start()
                pers.Wait()
        else:
            for _ in range(k):
                c.Iallreduce(MPI.IN_PLACE, buf, MPI.BAND).Wait()

    t_own, t_ar, r_own = paired(comm, own, allreduce, REPEATS)
    if pers is not None:
        pers.Free()
    t_own, t_ar = t_own / k, t_ar / k
    say(
        comm,
        f"floor: the sync point's own allreduce alone ({how} + Wait): "
        f"{t_own * 1e6:.1f} us, ratio to Allreduce {r_own:.2f}; "
        f"the empty sync point is {t_empty / t_own:.2f}x its own allreduce",
    )
    return {
        "bench": "sync_floor",
        "how": how,
        "own_us": t_own * 1e6,
        "allreduce_us": t_ar * 1e6,
        "ratio": r_own,
        "sync_over_own": t_empty / t_own,
    }


def against_garbage_cleanup(
    c: MPI.Intracomm, empty_sync: Callable[[], None], k: int
) -> list[dict[str, object]]:
    """The empty sync point / ``PETSc.garbage_cleanup`` with nothing to clean."""
    try:
        from petsc4py import PETSc
    except ImportError:
        say(comm, "garbage_cleanup: petsc4py not installed, row skipped")
        return []

    def cleanup() -> None:
        for _ in range(k):
            PETSc.garbage_cleanup(c)

    t_sync, t_gc, ratio = paired(comm, empty_sync, cleanup, REPEATS)
    say(
        comm,
        f"empty sync point {t_sync / k * 1e6:.1f} us, PETSc.garbage_cleanup with nothing "
        f"to clean {t_gc / k * 1e6:.1f} us: ratio {ratio:.2f}",
    )
    return [
        {
            "bench": "sync_vs_garbage_cleanup",
            "sync_us": t_sync / k * 1e6,
            "garbage_cleanup_us": t_gc / k * 1e6,
            "ratio": ratio,
        }
    ]


def live_dups(n: int = 100) -> list[dict[str, object]]:
    """An empty sync point of a communicator with ``n`` live ``cgc.dup``s of
    it, each with one live registration, beside the same with none: the
    duplicates are congruent with it, so they ride its agreement."""
    c = comm.Dup()
    cgc.manager(c)
    k = 500

    def empty_sync() -> None:
        for _ in range(k):
            cgc.collect(c, generation=None)

    # The Fortran index of a new communicator: how many a cgc.dup made
    # (indices are handed out in order while nothing is freed).
    def next_index() -> int:
        probe = c.Dup()
        index = probe.py2f()
        probe.Free()
        return index

    cgc.collect(c, generation=None)
    start = next_index()
    dups = [cgc.dup(c) for _ in range(n)]
    keep = [Res() for _ in range(n)]
    for d, r in zip(dups, keep):
        cgc.register(r, noop, comm=d)
    cgc.collect(c, generation=None)  # the first collective of each: nothing more is made
    per_dup = (next_index() - start) / n
    # Baseline: a communicator of the same size with no live duplicate; its
    # ranks in reverse order, so that it is not congruent with ``c`` (a Dup
    # would share c's agreement, duplicates and all).
    bare = comm.Split(0, comm.Get_size() - comm.Get_rank())
    cgc.manager(bare)

    def empty_bare() -> None:
        for _ in range(k):
            cgc.collect(bare, generation=None)

    t_with, t_none, ratio = paired(comm, empty_sync, empty_bare, REPEATS)
    say(
        comm,
        f"empty sync with {n} live cgc.dups (one registration each): {t_with / k * 1e6:.1f} us, "
        f"with none {t_none / k * 1e6:.1f} us: ratio {ratio:.2f}; "
        f"communicators held per cgc.dup: {per_dup:.2f} (a plain Dup: 1)",
    )
    keep.clear()
    dups.clear()
    cgc.collect(c, generation=None)
    cgc.collect(c, generation=None)
    return [
        {
            "bench": "sync_live_dups",
            "dups": n,
            "sync_us": t_with / k * 1e6,
            "none_us": t_none / k * 1e6,
            "ratio": ratio,
            "comms_per_dup": per_dup,
        }
    ]


def main() -> None:
    gc.disable()  # no automatic collection pauses inside the timings
    say(comm, f"bench_core: {comm.Get_size()} ranks, median of {REPEATS}, slowest rank per repeat")
    rows = per_object() + sync_costs() + live_dups()
    if "--no-save" not in sys.argv[1:]:
        save("core" if comm.Get_size() != 2 else "core_2ranks", rows, comm)


if __name__ == "__main__":
    main()
