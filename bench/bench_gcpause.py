"""GC pauses in a bulk-synchronous loop: Python's automatic collector vs managed GC.

The loop of the issue, on 4 ranks: every step makes cyclic garbage, in a
different amount on each rank, next to a modest live heap, and ends in an
Allreduce. Three ways to run it, in the same run, interleaved, median of 5:

- automatic: Python's collector as it is;
- managed: ``collective_scope(comm, gc="managed")`` with a sync point per
  step (the sync points' own cost is included): the ranks agree at each sync
  point on which generation to collect, and collect it together;
- by hand: gc off, a full ``gc.collect()`` on every rank every 20 steps (the
  issue's reference, measured there at 0.68-0.88 of automatic).

Two workloads, both printed:

- ``step-scoped`` (the target's): each step builds a tree of nodes with
  parent pointers (think of a per-step form, an expression DAG, a cache with
  back references) that stays alive until the step ends and only then becomes
  cyclic garbage. The automatic collector runs in the middle of the step,
  finds the tree alive, promotes it to older generations and later pays full
  collections for it; collecting at the sync point finds it dead in the
  young generation.
- ``instant``: self-referencing dicts that are garbage the moment they are
  made, the best case for the automatic collector (its young collections
  free them at once); managed GC can only tie here.

Ratios are to the automatic run (< 1 is better; target for managed on the
step-scoped loop: <= 0.70).

Run: mpiexec -n 4 python bench/bench_gcpause.py   (make bench)
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import collective_gc as cgc  # noqa: E402

from _common import save, say, timed  # noqa: E402

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
STEPS = 200
REPEATS = 5
HAND_EVERY = 20


class Node:
    __slots__ = ("parent", "children", "value")

    def __init__(self, parent: Node | None) -> None:
        self.parent = parent
        self.children: list[Node] = []
        self.value = 0.0


def step_scoped(rng: random.Random, live: list[object]) -> None:
    """A per-step tree with back references, used during the step, dropped at its end."""
    root = Node(None)
    nodes = [root]
    for _ in range(rng.randrange(800, 800 * (2 + rank))):
        parent = nodes[rng.randrange(len(nodes))]
        child = Node(parent)
        parent.children.append(child)
        nodes.append(child)
    for node in reversed(nodes):  # the step "uses" its tree: a bottom-up pass
        node.value = 1.0 + sum(c.value for c in node.children)
    live.append([{} for _ in range(5)])
    if len(live) > 2_500:
        del live[: rng.randrange(1, 100)]


def instant(rng: random.Random, live: list[object]) -> None:
    """Cycles that are garbage as soon as they are made."""
    for _ in range(rng.randrange(100, 400 + 300 * rank)):
        node: dict[str, object] = {"data": [0.0] * 4}
        node["self"] = node
    live.append([{} for _ in range(20)])
    if len(live) > 500:
        del live[: rng.randrange(1, 200)]


WORKLOADS: dict[str, Callable[[random.Random, list[object]], None]] = {
    "step-scoped": step_scoped,
    "instant": instant,
}


def run(mode: str, work: Callable[[random.Random, list[object]], None]) -> None:
    rng = random.Random(rank)
    live: list[object] = [[{} for _ in range(10)] for _ in range(2_000)]
    x = np.ones(8)
    y = np.empty_like(x)
    if mode == "managed":
        with cgc.collective_scope(comm, exit_collect=0) as scope:
            for _ in range(STEPS):
                work(rng, live)
                comm.Allreduce(x, y)
                scope.sync()
    elif mode == "by hand":
        was = gc.isenabled()
        gc.disable()
        try:
            for step in range(STEPS):
                work(rng, live)
                comm.Allreduce(x, y)
                if step % HAND_EVERY == HAND_EVERY - 1:
                    gc.collect()
        finally:
            if was:
                gc.enable()
    else:
        for _ in range(STEPS):
            work(rng, live)
            comm.Allreduce(x, y)
    del live
    gc.collect()


def main() -> None:
    say(comm, f"bench_gcpause: {comm.Get_size()} ranks, {STEPS} steps, a sync point per step")
    t0 = time.perf_counter()
    modes = ("automatic", "managed", "by hand")
    rows = []
    for name, work in WORKLOADS.items():
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(REPEATS):  # interleaved, so that load changes hit every mode
            for m in modes:
                times[m].append(timed(comm, lambda m=m, w=work: run(m, w), 1))
        med = {m: statistics.median(v) for m, v in times.items()}
        ratio = statistics.median(a / b for a, b in zip(times["managed"], times["automatic"]))
        hand = statistics.median(a / b for a, b in zip(times["by hand"], times["automatic"]))
        target = name == "step-scoped"
        say(
            comm,
            f"{name} loop: automatic GC {med['automatic']:.3f} s, managed GC "
            f"{med['managed']:.3f} s, by hand {med['by hand']:.3f} s; ratio managed/automatic "
            f"{ratio:.2f}{' (target <= 0.70)' if target else ''}, by hand/automatic {hand:.2f} "
            f"(median of {REPEATS}; {time.perf_counter() - t0:.0f} s so far)",
        )
        row: dict[str, object] = {
            "bench": f"gcpause {name}",
            "auto_s": med["automatic"],
            "managed_s": med["managed"],
            "hand_s": med["by hand"],
            "hand_ratio": hand,
            "ratio": ratio,
        }
        if target:
            row["target"] = "<= 0.70"
        rows.append(row)
    save("gcpause", rows, comm)


if __name__ == "__main__":
    main()
