"""GC pauses in a bulk-synchronous loop: Python's automatic collector vs managed GC.

The loop of the issue: on every rank, cyclic garbage in a different amount
per rank, a modest live heap, and an Allreduce every step. With the automatic
collector each rank pauses for its collections at its own moment and the
others wait for it in the Allreduce, so the pauses of all ranks add up.
Inside ``collective_scope(comm, gc="managed")`` with a sync point per step,
the ranks agree at each sync point on which generation to collect and pause
together; the sync points' own cost is included. For reference, the
hand-written equivalent: gc off, a full ``gc.collect()`` on every rank every
20 steps.

Same run, interleaved repeats, median of 5: ratios to the automatic run
(< 1 is better; target for managed: <= 0.70).

Run: mpiexec -n 4 python bench/bench_gcpause.py   (make bench)
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import collective_gc as cgc  # noqa: E402

from _common import save, say, timed  # noqa: E402

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
STEPS = 400
REPEATS = 5


def step_work(rng: random.Random, live: list[object]) -> None:
    for _ in range(rng.randrange(100, 400 + 300 * rank)):
        node: dict[str, object] = {"data": [0.0] * 4}
        node["self"] = node  # a cycle: only the collector frees it
    live.append([{} for _ in range(20)])
    if len(live) > 500:
        del live[: rng.randrange(1, 200)]


def run(mode: str) -> None:
    rng = random.Random(rank)
    live: list[object] = [[{} for _ in range(10)] for _ in range(2_000)]
    x = np.ones(8)
    y = np.empty_like(x)
    if mode == "managed":
        with cgc.collective_scope(comm, exit_collect=0) as scope:
            for _ in range(STEPS):
                step_work(rng, live)
                comm.Allreduce(x, y)
                scope.sync()
    elif mode == "by hand":
        was = gc.isenabled()
        gc.disable()
        try:
            for step in range(STEPS):
                step_work(rng, live)
                comm.Allreduce(x, y)
                if step % 20 == 19:
                    gc.collect()
        finally:
            if was:
                gc.enable()
    else:
        for _ in range(STEPS):
            step_work(rng, live)
            comm.Allreduce(x, y)
    del live
    gc.collect()


def main() -> None:
    say(comm, f"bench_gcpause: {comm.Get_size()} ranks, {STEPS} steps, a sync point per step")
    t0 = time.perf_counter()
    modes = ("automatic", "managed", "by hand")
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(REPEATS):  # interleaved, so that load changes hit every mode
        for m in modes:
            times[m].append(timed(comm, lambda m=m: run(m), 1))
    med = {m: statistics.median(v) for m, v in times.items()}
    ratio = statistics.median(a / b for a, b in zip(times["managed"], times["automatic"]))
    hand = statistics.median(a / b for a, b in zip(times["by hand"], times["automatic"]))
    say(
        comm,
        f"bulk-synchronous loop: automatic GC {med['automatic']:.3f} s, managed GC "
        f"{med['managed']:.3f} s, by hand {med['by hand']:.3f} s; ratio managed/automatic "
        f"{ratio:.2f} (target <= 0.70), by hand/automatic {hand:.2f} "
        f"(median of {REPEATS}; {time.perf_counter() - t0:.0f} s)",
    )
    save(
        "gcpause",
        [
            {
                "bench": "gcpause",
                "auto_s": med["automatic"],
                "managed_s": med["managed"],
                "hand_s": med["by hand"],
                "ratio": ratio,
                "target": "<= 0.70",
            }
        ],
        comm,
    )


if __name__ == "__main__":
    main()
