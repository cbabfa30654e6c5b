"""GC pauses in a bulk-synchronous loop: Python's automatic collector vs managed GC.

The loop of the issue, on 4 ranks: every step makes cyclic garbage, in a
different amount on each rank, and ends in an Allreduce. Four ways to run
it, and a reference, in the same run, interleaved, median of 5:

- automatic: Python's collector as it is;
- managed: ``collective_scope(comm, gc="managed")`` with a sync point per
  step (the sync points' own cost is included): the ranks agree at each sync
  point on which generation to collect, and collect it together; the scope
  has ``exit_collect=0`` (a young collection before its exit sync);
- managed, full exit: the same with the scope's default ``exit_collect=2``
  (a full collection before the exit sync, so that nothing dropped inside
  the scope stays queued; it walks the whole heap, once per scope);
- by hand: gc off, a full ``gc.collect()`` on every rank every 20 steps (the
  issue's reference, measured there at 0.68-0.88 of automatic);
- no collection: gc off, nothing collected in the loop: no collection
  pause at all, printed so that a ratio can be read against what is left to
  win. It is a floor only where the garbage is small beside the heap: where
  it is large, piling it up (memory never reused) costs more than collecting.

Three workloads, all printed:

- ``step-scoped``: each step builds a tree of nodes with parent pointers
  (think of a per-step form, an expression DAG, a cache with back references)
  that stays alive until the step ends and only then becomes cyclic garbage,
  next to a modest live heap. The automatic collector runs in the middle of
  the step, finds the tree alive, promotes it to older generations and later
  pays full collections for it; collecting at the sync point finds it dead in
  the young generation.
- ``heap``: the step-scoped loop, unchanged, over a
  large long-lived heap built before the loop (a mesh of cells with
  neighbour cycles, about 2.4 million tracked objects per rank). A full
  collection now costs a walk over the whole heap; the automatic collector
  makes one rank pay it at a step of its own while the others wait. The heap
  is built once, untimed; before each timed run a full collection (untimed)
  puts every mode in the same collector state, and no collection follows the
  run (in the other two workloads a full collection ends each timed run, so
  that no mode leaves garbage for later).
- ``instant``: self-referencing dicts that are garbage the moment they are
  made, the best case for the automatic collector (its young collections
  free them at once); managed GC can only tie here.

Ratios are to the automatic run (< 1 is better; the targets are in
bench/results/REPORT.md). Also printed:
the full collections the loops made, all ranks together (a gc callback), which
is where the automatic collector's time goes.

Run: mpiexec -n 4 python bench/bench_gcpause.py   (make bench)
``--only NAME`` runs one workload (results are saved only for a full run);
``--repeats N`` (default 5).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import collective_gc as cgc  # noqa: E402

from _common import save, say, timed  # noqa: E402

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
STEPS = 200
HAND_EVERY = 20
MESH_CELLS = 400_000  # 6 tracked objects each


class Node:
    __slots__ = ("parent", "children", "value")

    def __init__(self, parent: Node | None) -> None:
        self.parent = parent
        self.children: list[Node] = []
        self.value = 0.0


class Cell:
    """A mesh cell: its vertices, its neighbours (cycles through the mesh), its fields."""

    __slots__ = ("vertices", "neighbours", "fields")

    def __init__(self, i: int) -> None:
        self.vertices = [i, i + 1, i + 2]
        self.neighbours: list[Cell] = []
        self.fields = {"u": [0.0, 0.0], "p": [0.0]}


def build_mesh(n: int) -> list[Cell]:
    cells = [Cell(i) for i in range(n)]
    for i, cell in enumerate(cells):
        cell.neighbours.extend((cells[i - 1], cells[(i + 1) % n]))
    return cells


MESH: list[Cell] = []


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


@dataclass
class Workload:
    step: Callable[[random.Random, list[object]], None]
    live: Callable[[], list[object]]  # the long-lived list the steps grow, made in the timed run
    exit_collect: int  # the managed scope's exit collection ("managed, full exit": 2)
    heap: int = 0  # cells of the long-lived mesh built before the runs
    clean_setup: bool = False  # a full collection, untimed, before each run (and none after)


WORKLOADS: dict[str, Workload] = {
    "step-scoped": Workload(
        step_scoped, lambda: [[{} for _ in range(10)] for _ in range(2_000)], 0
    ),
    "heap": Workload(
        step_scoped,
        lambda: [[{} for _ in range(10)] for _ in range(2_000)],
        0,
        heap=MESH_CELLS,
        clean_setup=True,
    ),
    "instant": Workload(instant, lambda: [[{} for _ in range(10)] for _ in range(2_000)], 0),
}


FULL = [0]  # full collections (generation 2) on this rank, counted by a gc callback
LOOP_FULL = [0]  # those of the last run's loop (scope exit included, final clean-up not)


def run(mode: str, w: Workload) -> None:
    rng = random.Random(rank)
    live = w.live()
    x = np.ones(8)
    y = np.empty_like(x)
    if mode.startswith("managed"):
        exit_collect = 2 if mode == "managed, full exit" else w.exit_collect
        with cgc.collective_scope(comm, exit_collect=exit_collect) as scope:
            for _ in range(STEPS):
                w.step(rng, live)
                comm.Allreduce(x, y)
                scope.sync()
    elif mode in ("by hand", "no collection"):
        every = HAND_EVERY if mode == "by hand" else STEPS + 1
        was = gc.isenabled()
        gc.disable()
        try:
            for step in range(STEPS):
                w.step(rng, live)
                comm.Allreduce(x, y)
                if step % every == every - 1:
                    gc.collect()
        finally:
            if was:
                gc.enable()
    else:
        for _ in range(STEPS):
            w.step(rng, live)
            comm.Allreduce(x, y)
    LOOP_FULL[0] = FULL[0]
    del live
    if not w.clean_setup:
        gc.collect()


def count_full(phase: str, info: dict[str, int]) -> None:
    if phase == "start" and info["generation"] == 2:
        FULL[0] += 1


def timed_run(mode: str, w: Workload, setup: Callable[[], object] | None) -> tuple[float, int]:
    """The slowest rank's time of one run, and the full collections all ranks made in it."""
    if setup is not None:
        setup()
    FULL[0] = 0
    t = timed(comm, lambda: run(mode, w), 1)
    return t, comm.allreduce(LOOP_FULL[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    repeats = args.repeats
    say(comm, f"bench_gcpause: {comm.Get_size()} ranks, {STEPS} steps, a sync point per step")
    gc.callbacks.append(count_full)
    t0 = time.perf_counter()
    rows = []
    for name, w in WORKLOADS.items():
        if args.only not in (None, name):
            continue
        modes = ["automatic", "managed", "by hand", "no collection"]
        if w.exit_collect != 2:
            modes.insert(2, "managed, full exit")
        if w.heap:
            MESH[:] = build_mesh(w.heap)
            gc.collect()
            tracked = comm.allreduce(len(gc.get_objects()), op=MPI.MIN)
            say(comm, f"{name}: long-lived heap of {tracked:,} tracked objects per rank (fewest)")
        setup = gc.collect if w.clean_setup else None
        times: dict[str, list[float]] = {m: [] for m in modes}
        fulls: dict[str, list[int]] = {m: [] for m in modes}
        for _ in range(repeats):  # interleaved, so that load changes hit every mode
            for m in modes:
                t, full = timed_run(m, w, setup)
                times[m].append(t)
                fulls[m].append(full)
        MESH.clear()
        med = {m: statistics.median(v) for m, v in times.items()}
        ratios = {
            m: statistics.median(a / b for a, b in zip(times[m], times["automatic"])) for m in modes
        }
        say(
            comm,
            f"{name} loop (median of {repeats}; {time.perf_counter() - t0:.0f} s so far):\n"
            + "\n".join(
                f"  {m:18s} {med[m]:7.3f} s  ratio to automatic {ratios[m]:.2f}"
                f"  full collections in the loop, all ranks: {statistics.median(fulls[m]):g}"
                for m in modes
            ),
        )
        row: dict[str, object] = {
            "bench": f"gcpause {name}",
            "auto_s": med["automatic"],
            "managed_s": med["managed"],
            "hand_s": med["by hand"],
            "hand_ratio": ratios["by hand"],
            "floor_s": med["no collection"],
            "floor_ratio": ratios["no collection"],
            "ratio": ratios["managed"],
            "auto_full": statistics.median(fulls["automatic"]),
            "managed_full": statistics.median(fulls["managed"]),
        }
        if "managed, full exit" in modes:
            row["managed_full_exit_s"] = med["managed, full exit"]
            row["full_exit_ratio"] = ratios["managed, full exit"]
        rows.append(row)
    if args.only is None:
        save("gcpause", rows, comm)


if __name__ == "__main__":
    main()
