"""GC pauses in a bulk-synchronous loop: Python's automatic collector vs managed GC.

A simulation-like loop on every rank: a large long-lived heap that keeps
growing (caches, meshes), short-lived objects in reference cycles, a
different amount of allocation per rank, and an Allreduce every step. With
the automatic collector each rank pauses for its collections, full ones
included, at its own moment, and the others wait for it in the Allreduce, so
the pauses of all ranks add up. Inside ``collective_scope(comm)``
(``gc="managed"``) the ranks agree at each sync point on which generation to
collect and pause together.

Same run, interleaved repeats, median of 5: ratio managed / automatic (< 1 is
better).

Run: mpiexec -n 4 python bench/bench_gcpause.py   (make bench)
"""

from __future__ import annotations

import gc
import random
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import collective_gc as cgc  # noqa: E402

from _common import paired, save, say  # noqa: E402

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
STEPS = 400
SYNC_EVERY = 5
REPEATS = 5


def step_work(rng: random.Random, heap: list[object]) -> None:
    for _ in range(rng.randrange(100, 300 + 200 * rank)):
        a: list[object] = []
        b = [a]
        a.append(b)  # a cycle: only the collector frees it
    # The long-lived heap grows (a cache), a different amount on each rank.
    heap.append([{} for _ in range(rng.randrange(100, 300 + 100 * rank))])


def loop(managed: bool) -> None:
    rng = random.Random(rank)
    heap: list[object] = [[{} for _ in range(10)] for _ in range(20_000)]
    x = np.ones(8)
    y = np.empty_like(x)
    if managed:
        # exit_collect=0: the full collection a scope's exit does by default
        # would be a pause the automatic run does not have.
        with cgc.collective_scope(comm, exit_collect=0) as scope:
            for step in range(STEPS):
                step_work(rng, heap)
                comm.Allreduce(x, y)
                if step % SYNC_EVERY == SYNC_EVERY - 1:
                    scope.sync()
    else:
        for _ in range(STEPS):
            step_work(rng, heap)
            comm.Allreduce(x, y)
    del heap
    gc.collect()  # outside the timed region's steps, the same in both runs


def main() -> None:
    say(comm, f"bench_gcpause: {comm.Get_size()} ranks, {STEPS} steps, sync every {SYNC_EVERY}")
    t0 = time.perf_counter()
    t_man, t_auto, ratio = paired(comm, lambda: loop(True), lambda: loop(False), REPEATS)
    say(
        comm,
        f"bulk-synchronous loop: automatic GC {t_auto:.3f} s, managed GC {t_man:.3f} s, "
        f"ratio managed/automatic {ratio:.2f} "
        f"(median of {REPEATS}; {time.perf_counter() - t0:.0f} s)",
    )
    save(
        "gcpause",
        [
            {
                "bench": "gcpause",
                "auto_s": t_auto,
                "managed_s": t_man,
                "ratio": ratio,
                "steps": STEPS,
            }
        ],
        comm,
    )


if __name__ == "__main__":
    main()
